"""A fake Executor for scheduler tests: deterministic tokens, lazy or threaded futures,
and a fake runner that checks every SchedulerOutput against what a real worker keeps.

Tokens: the token at position p of request r is ``expected_token(r, p)`` (never EOS), or
``EOS`` where the test asked for a stop. The fake runner mirrors the worker's persistent
state from the diffs and checks, on every step: its computed count equals the scheduler's,
every input token is known on the device, written blocks belong to the writer alone (a
block freed too early would show up here), prefix hits read KV with the right content.
"""

from __future__ import annotations

import collections
import random
import threading
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import ClassVar

from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.scheduler.config.speculative_config import SpeculativeConfig
from raylm.scheduler.core_outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from raylm.scheduler.request import Request
from raylm.scheduler.sampling_params import SamplingParams

EOS = 2
VOCAB = 1000
# What a request computed on KV that failed to load samples (never an expected token).
POISON = VOCAB + 1


def expected_token(req_id: str, position: int) -> int:
    return 10 + zlib.crc32(f"{req_id}@{position}".encode()) % (VOCAB - 10)


def prompt_tokens(seed: str, n: int) -> list[int]:
    return [expected_token("prompt:" + seed, i) for i in range(n)]


def make_config(*, async_scheduling: bool, block_size: int = 4, num_kv_blocks: int | None = None,
                max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                max_model_len: int = 256, enable_prefix_caching: bool = True,
                pipeline_parallel_size: int = 1, num_spec_tokens: int = 0,
                draft_model_dir: str | None = None) -> EngineConfig:
    """``draft_model_dir``: speculate with method draft_model (a folder whose config.json
    has this fake's vocab_size; the fake runner proposes the drafts either way), which
    books KV slots ahead of each step without PP."""
    model = ModelConfig(model="fake", max_model_len=max_model_len, hf_config={
        "architectures": ["LlamaForCausalLM"], "max_position_embeddings": max_model_len,
        "vocab_size": VOCAB, "eos_token_id": EOS})
    config = EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                 enable_prefix_caching=enable_prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         async_scheduling=async_scheduling),
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
        speculative_config=(None if not num_spec_tokens else
                            SpeculativeConfig("ngram", num_spec_tokens) if draft_model_dir is None
                            else SpeculativeConfig("draft_model", num_spec_tokens,
                                                   model=draft_model_dir)),
    )
    return config


def write_draft_model_config(folder: str) -> str:
    """A stand-in draft model folder for ``make_config(draft_model_dir=...)``."""
    import json
    import os

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"vocab_size": VOCAB}, f)
    return folder


def make_request(req_id: str, prompt: list[int] | int, max_tokens: int | None = 8,
                 max_model_len: int = 256, **params: object) -> Request:
    if isinstance(prompt, int):
        prompt = prompt_tokens(req_id, prompt)
    params.setdefault("ignore_eos", True)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(req_id, prompt, sp, frozenset({EOS}), max_model_len, sampling_seed=0)


class _ReqState:
    def __init__(self, tokens: list[int], num_prompt: int, block_ids: list[int],
                 num_computed: int, logprobs: int | None) -> None:
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.logprobs = logprobs
        self.poisoned = False  # it read KV whose load failed: its outputs are garbage
        self.first_bad = -1  # the first position it read garbage at


class FakeRunner:
    """What a worker does with SchedulerOutputs, minus the model."""

    def __init__(self, num_blocks: int, block_size: int,
                 eos_at: dict[str, int] | None = None,
                 spec_rng: random.Random | None = None) -> None:
        # Speculative decoding: how many of the booked drafts the worker proposes and how
        # many are accepted, drawn from ``spec_rng`` (None: all proposed, all accepted).
        self.spec_rng = spec_rng
        self.num_accepted: collections.Counter[str] = collections.Counter()
        self.saw_drafts = False
        self.block_size = block_size
        self.eos_at = eos_at if eos_at is not None else {}  # req_id -> output index of EOS
        self.reqs: dict[str, _ReqState] = {}
        self.block_users: dict[int, set[str]] = collections.defaultdict(set)
        # KV content per slot: (token, position) written there, None if never written.
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.last_step_id = 0
        self.scheduled_tokens: collections.Counter[str] = collections.Counter()
        self.num_sampled: collections.Counter[str] = collections.Counter()
        self.num_steps = 0
        # A fake KV connector's worker side (sched_fake_kv.py): moves the fake KV before a
        # step and reports with it.
        self.kv_worker = None

    def token_at(self, req_id: str, st: _ReqState, position: int) -> int:
        if self.eos_at.get(req_id) == position - st.num_prompt:
            return EOS
        return expected_token(req_id, position)

    def _drop(self, req_id: str) -> None:
        st = self.reqs.pop(req_id, None)
        if st is not None:
            for b in st.block_ids:
                self.block_users[b].discard(req_id)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert so.step_id > self.last_step_id, (so.step_id, self.last_step_id)
        self.last_step_id = so.step_id
        self.num_steps += 1
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._drop(rid)
        spoiled = self.kv_worker.before_step(so, self) if self.kv_worker is not None else set()
        for nd in so.scheduled_new_reqs:
            assert nd.req_id not in self.reqs, f"{nd.req_id} sent as new twice"
            st = _ReqState(list(nd.prompt_token_ids) + list(nd.output_token_ids),
                           len(nd.prompt_token_ids), list(nd.block_ids),
                           nd.num_computed_tokens, nd.sampling_params.logprobs)
            for i, tok in enumerate(nd.output_token_ids):  # confirmed outputs are right
                pos = st.num_prompt + i
                assert tok == self.token_at(nd.req_id, st, pos), (nd.req_id, pos, tok)
            self.reqs[nd.req_id] = st
            for b in st.block_ids:
                self.block_users[b].add(nd.req_id)
            for pos in range(nd.num_computed_tokens):  # a prefix hit reads the right KV
                block = st.block_ids[pos // self.block_size]
                if block in spoiled:  # loaded in this very step, and the load failed
                    if not st.poisoned:
                        st.poisoned, st.first_bad = True, pos
                    continue
                slot = self.kv[block][pos % self.block_size]
                assert slot == (st.tokens[pos], pos), (nd.req_id, pos, slot, st.tokens[pos])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs[rid]
            # With drafts in flight the scheduler books as if all were accepted; the
            # worker's own count trails by the rejections it has not seen yet.
            lag = cached.num_computed_tokens[i] - st.num_computed
            assert lag == 0 or (self.saw_drafts and 0 < lag), (
                rid, st.num_computed, cached.num_computed_tokens[i])
            st.block_ids.extend(cached.new_block_ids[i])
            for b in cached.new_block_ids[i]:
                self.block_users[b].add(rid)
        req_ids, sampled, logprobs, proposed = [], [], [], []
        spec = so.scheduled_spec_decode_tokens
        self.saw_drafts |= bool(spec)
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            self.scheduled_tokens[rid] += n
            start = st.num_computed
            num_booked = len(spec.get(rid, ()))
            num_known = n - num_booked
            assert n > 0 and start + num_known <= len(st.tokens), (
                rid, start, n, num_booked, len(st.tokens))
            assert num_booked == 0 or start + num_known == len(st.tokens), (
                f"{rid}: drafts booked on a prefill chunk", start, n, len(st.tokens))
            num_drafts = num_accepted = num_booked
            if num_booked and self.spec_rng is not None:
                num_drafts = self.spec_rng.randint(0, num_booked)
                num_accepted = self.spec_rng.randint(0, num_drafts)
            # Accepted drafts are the tokens the target samples; rejected ones are garbage.
            inputs = st.tokens[start:start + num_known] + [
                self.token_at(rid, st, len(st.tokens) + j) if j < num_accepted else -7
                for j in range(num_drafts)]
            for pos, tok in enumerate(inputs, start):
                block = st.block_ids[pos // self.block_size]
                assert self.block_users[block] == {rid}, (
                    f"step {so.step_id}: {rid} writes block {block} shared with "
                    f"{self.block_users[block]}")
                self.kv[block][pos % self.block_size] = (
                    ("poison", pos) if st.poisoned else (tok, pos))
            st.num_computed = start + num_known
            out: list[int] = []
            if st.num_computed == len(st.tokens):  # the last known token was an input
                for _ in range(1 + num_accepted):
                    tok = POISON if st.poisoned else self.token_at(rid, st, len(st.tokens))
                    st.tokens.append(tok)
                    out.append(tok)
                st.num_computed += num_accepted
                self.num_sampled[rid] += 1
                self.num_accepted[rid] += num_accepted
            if st.poisoned and st.first_bad >= 0 and self.kv_worker is not None:
                # What the scheduler must recompute: all this step settled from there on.
                self.kv_worker.expected_lost += st.num_computed - st.first_bad
                st.first_bad = -1
            req_ids.append(rid)
            proposed.append(num_drafts)
            sampled.append(out)
            logprobs.append(LogprobsLists([[t] for t in out], [[-0.5] for _ in out], [1 for _ in out])
                            if st.logprobs is not None else None)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            num_draft_tokens=proposed if spec else None,
            kv_connector_output=(self.kv_worker.after_step(so, self)
                                 if self.kv_worker is not None else None))


class LazyFuture(Future):
    """Resolves (runs its step and every earlier one) when someone asks for the result."""

    def __init__(self, executor: FakeExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            self._executor.resolve_until(self)
        return super().result(timeout)


@dataclass(eq=False)
class FakeExecutor:
    """Executor protocol over FakeRunner. ``mode``: "lazy" (steps run in order when a
    result is demanded or ``resolve_next()`` is called) or "thread" (a background
    thread runs them in order, optionally sleeping ``step_time`` each)."""

    supports_async_scheduling: ClassVar[bool] = True

    num_blocks: int = 64
    block_size: int = 4
    mode: str = "lazy"
    eos_at: dict[str, int] | None = None
    fail_at_step: int | None = None
    step_time: float = 0.0
    spec_rng: random.Random | None = None
    kv_worker: object = None  # a fake KV connector's worker side (sched_fake_kv.py)
    # Run state, not options.
    runner: FakeRunner | None = field(default=None, init=False)
    pending: collections.deque[tuple[Future, SchedulerOutput]] = field(
        default_factory=collections.deque, init=False)
    history: list[SchedulerOutput] = field(default_factory=list, init=False)
    shut_down: bool = field(default=False, init=False)
    _cv: threading.Condition = field(default_factory=threading.Condition, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _stop: bool = field(default=False, init=False)

    def determine_num_kv_blocks(self) -> int:
        return self.num_blocks

    def device_info(self) -> dict:
        return {"kind": "fake", "name": "FakeRunner", "count": 1}

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner = FakeRunner(num_blocks, self.block_size, self.eos_at, self.spec_rng)
        self.runner.kv_worker = self.kv_worker
        if self.mode == "thread":
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.fail_at_step is not None and so.step_id >= self.fail_at_step:
            raise RuntimeError(f"fake device fault at step {so.step_id}")
        assert self.runner is not None
        return self.runner.execute(so)

    def _complete(self, fut: Future, so: SchedulerOutput) -> None:
        try:
            fut.set_result(self._run(so))
        except Exception as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
        self.history.append(scheduler_output)
        fut: Future = LazyFuture(self) if self.mode == "lazy" else Future()
        with self._cv:
            self.pending.append((fut, scheduler_output))
            self._cv.notify()
        return fut if non_block else fut.result()

    def resolve_next(self) -> bool:
        with self._cv:
            if not self.pending:
                return False
            fut, so = self.pending.popleft()
        self._complete(fut, so)
        return True

    def resolve_until(self, target: Future) -> None:
        while not target.done():
            assert self.resolve_next(), "future not pending"

    def _loop(self) -> None:
        import time
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.pending or self._stop)
                if self._stop:
                    return
                fut, so = self.pending.popleft()
            if self.step_time:
                time.sleep(self.step_time)
            self._complete(fut, so)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.shut_down = True
        with self._cv:
            self._stop = True
            self._cv.notify()


def with_async(config: EngineConfig, on: bool) -> EngineConfig:
    return replace(config, scheduler_config=replace(config.scheduler_config, async_scheduling=on))


def collect(outputs) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Token stream and list of final outputs per request, from EngineCoreOutput lists."""
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    finals: dict[str, list] = collections.defaultdict(list)
    for o in outputs:
        tokens[o.request_id].extend(o.new_token_ids)
        if o.finished:
            finals[o.request_id].append(o)
    return dict(tokens), dict(finals)


def expected_stream(req: Request, eos_index: int | None = None) -> list[int]:
    """What the fake produces for ``req`` when nothing stops it early."""
    n = req.max_tokens
    out = [expected_token(req.request_id, req.num_prompt_tokens + i) for i in range(n)]
    if eos_index is not None and eos_index < n:
        out[eos_index] = EOS
    return out
