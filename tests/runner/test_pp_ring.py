"""The async-PP sampled-token ring (runner/pp_ring.py): delivery exactly pp_size steps
later, empty steps included; no token delivered to a row freed and reused meanwhile.
Then the whole PP path without Ray: every stage a real Worker, stages run back to back in
one thread over a loopback transport, driven by the real EngineCore (cadence, pp + 1
batches in flight), greedy output against transformers with preemption and chunked prefill."""

from __future__ import annotations

import random
import shutil
from concurrent.futures import Future

import pytest
import torch
from conftest import hf_greedy
from engine_drive import run_until_idle

from raylm.parallel.context import ParallelContext
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.runner.pp_ring import SampledTokenRing
from raylm.runner.spec_decode.draft_gate import DRAFTER_DECAY, PROMPT_LOOKUP_DECAY
from raylm.runner.worker import Worker
from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.scheduler.config.speculative_config import SpeculativeConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.request import Request
from raylm.scheduler.sampling_params import SamplingParams


class _Recv:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


# ---------------------------------------------------------------- the ring alone
@pytest.mark.parametrize("pp_size", [2, 3, 4])
def test_each_broadcast_comes_back_exactly_pp_steps_later_empty_steps_included(pp_size):
    ring = SampledTokenRing(pp_size)
    ring.add_request("a")
    rng = random.Random(pp_size)
    sent: dict[int, str] = {}
    for step in range(40):
        delivery = ring.take()
        source = step - pp_size
        if source in sent:
            assert delivery is not None and delivery.pending.wait() == sent[source]
            assert delivery.step_index == source and delivery.req_id_to_index == {"a": 0}
        else:  # before the first step, or an empty step pp_size steps ago
            assert delivery is None
        if rng.random() < 0.3:
            ring.put(None)  # an empty step: nothing broadcast, the ring still advances
        else:
            sent[step] = f"ids of step {step}"
            ring.put(_Recv(sent[step]), {"a": 0})
    assert ring.num_steps == 40


def test_tokens_of_a_row_freed_and_reused_meanwhile_are_dropped():
    ring = SampledTokenRing(2)
    for r in ("a", "b", "c"):
        ring.add_request(r)
    row_b = ring.row_of("b")
    ring.take()
    ring.put(_Recv("step0"), {"a": 0, "b": 1, "c": 2})
    # Step 1: "b" finishes, "d" arrives and gets b's row (LIFO); "c" is preempted and
    # re-added at once (same id, new state).
    ring.remove_request("b")
    ring.add_request("d")
    assert ring.row_of("d") == row_b
    ring.remove_request("c")
    ring.add_request("c")
    ring.take()
    ring.put(_Recv("step1"), {"d": 0})
    delivery = ring.take()  # step 2 takes step 0
    assert delivery.pending.wait() == "step0"
    assert delivery.req_id_to_index == {"a": 0}
    assert delivery.keep.tolist() == [True, False, False] and delivery.num_dropped == 2
    assert ring.num_tokens_dropped == 2 and ring.num_delivered == 1
    ring.put(None)
    delivery = ring.take()  # step 3 takes step 1: d still holds its row
    assert delivery.req_id_to_index == {"d": 0}


def test_rows_grow_and_misuse_is_refused():
    ring = SampledTokenRing(2, initial_rows=1)
    rows = [ring.add_request(f"r{i}") for i in range(5)]
    assert sorted(rows) == list(range(5))
    with pytest.raises(ValueError, match="'r0' already holds"):
        ring.add_request("r0")
    ring.remove_request("never-added")  # ignored
    with pytest.raises(RuntimeError, match="without take"):
        ring.put(None)
    ring.take()
    with pytest.raises(RuntimeError, match="take\\(\\) twice"):
        ring.take()
    with pytest.raises(ValueError, match="pp_size"):
        SampledTokenRing(1)


# ---------------------------------------------------------------- stages in one process
class _Hub:
    """What the loopback transports share: hidden states per stage boundary, and every
    broadcast in order (a receive names its broadcast by sequence number)."""

    def __init__(self, pp_size: int) -> None:
        self.hidden = [[] for _ in range(pp_size)]
        self.broadcasts: list[torch.Tensor] = []


class _LoopbackTransport:
    def __init__(self, hub: _Hub, pp_rank: int) -> None:
        self.hub, self.pp_rank = hub, pp_rank
        self.num_posted = 0
        self.num_waits = 0

    def recv_intermediate(self, so):
        t = self.hub.hidden[self.pp_rank - 1].pop(0)
        assert t.hidden_states.shape[0] == so.total_num_scheduled_tokens
        return t

    def send_intermediate(self, tensors):
        self.hub.hidden[self.pp_rank].append(tensors)

    def broadcast_sampled_token_ids(self, sampled):
        self.hub.broadcasts.append(sampled.clone())

    def recv_sampled_token_ids(self, num_rows, width=1):
        seq, hub, transport = self.num_posted, self.hub, self
        self.num_posted += 1

        class _Pending:
            def wait(self):
                # The stages run back to back: the broadcast must have happened already
                # (a ring that consumed early would fail here).
                assert seq < len(hub.broadcasts), f"broadcast #{seq} consumed before sent"
                assert hub.broadcasts[seq].shape == (num_rows, width)
                transport.num_waits += 1
                return hub.broadcasts[seq]

        return _Pending()

    def close(self):
        pass


class _BackToBackPipeline:
    """Executor protocol: each step runs on every stage in order (no overlap, same data
    flow and cadence as the Ray workers)."""

    supports_async_scheduling = True

    def __init__(self, config: EngineConfig, pp_size: int) -> None:
        self.hub = _Hub(pp_size)
        self.workers = []
        for rank in range(pp_size):
            w = Worker(config, rank=rank)
            w.init_device(ParallelContext(tp_rank=0, tp_size=1, pp_rank=rank, pp_size=pp_size,
                                          dp_rank=0, device=torch.device("cpu")), num_threads=1)
            w.load_model()
            w.pp_transport = _LoopbackTransport(self.hub, rank)
            self.workers.append(w)

    def determine_num_kv_blocks(self):
        return min(w.determine_num_kv_blocks() for w in self.workers)

    def device_info(self):
        return {**self.workers[0].device_info(), "count": len(self.workers)}

    def initialize_kv_cache(self, num_blocks):
        for w in self.workers:
            w.initialize_kv_cache(num_blocks)

    def execute_model(self, so, non_block=False):
        for w in self.workers[:-1]:
            assert w.execute_model(so) is None
        out = self.workers[-1].execute_model(so)
        out = out.get_output() if hasattr(out, "get_output") else out
        future: Future = Future()
        future.set_result(out)
        return future if non_block else out

    def check_health(self):
        pass

    def shutdown(self):
        for w in self.workers:
            w.shutdown()


def _config(path, pp_size, async_scheduling, **sched):
    return EngineConfig(ModelConfig(model=path), CacheConfig(block_size=4, num_kv_blocks=20),
                        SchedulerConfig(async_scheduling=async_scheduling, **sched),
                        ParallelConfig(pipeline_parallel_size=pp_size))


@pytest.fixture(scope="module")
def three_layer_path(tmp_path_factory):
    return write_random_checkpoint(str(tmp_path_factory.mktemp("llama3l")),
                                   CheckpointSpec(num_hidden_layers=3, seed=4))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("pp_size", [2, 3])
def test_back_to_back_stages_match_transformers(llama_path, three_layer_path, pp_size,
                                                async_scheduling):
    path = llama_path if pp_size == 2 else three_layer_path
    # 20 blocks of 4 tokens cannot hold all six at full length (preemption); a 16-token
    # budget chunks the long prompts.
    config = _config(path, pp_size, async_scheduling, max_num_seqs=6, max_num_batched_tokens=16)
    executor = _BackToBackPipeline(config, pp_size)
    core = EngineCore(config, executor)
    assert core.batch_queue_size == pp_size + (1 if async_scheduling else 0)
    rng = random.Random(pp_size)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 21, 9, 30, 14, 6)]
    max_tokens = [18, 12, 24, 10, 20, 16]
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        core.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=m,
                                                            ignore_eos=True),
                                 frozenset(), config.model_config.max_model_len, sampling_seed=i))
    tokens: dict[str, list[int]] = {}
    for out in run_until_idle(core):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert core.scheduler.counters.num_preemptions > 0
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert tokens[f"r{i}"] == hf_greedy(path, p, m), f"r{i}"
    if async_scheduling:
        # Every stage but the last consumed every broadcast but those still in its ring,
        # and stage 0 filled decode inputs from them on the device.
        num_broadcasts = len(executor.hub.broadcasts)
        for w in executor.workers[:-1]:
            ring = w.model_runner.pp_ring
            assert w.pp_transport.num_posted == num_broadcasts
            assert w.pp_transport.num_waits == num_broadcasts - len(ring.pending_slots())
        stats = executor.workers[0].model_runner.async_input_stats
        assert stats.slice_copy + stats.scatter > 0
    else:
        assert executor.hub.broadcasts == []
    core.shutdown()


def _run_engine(config, executor, prompts, params) -> dict[str, list[int]]:
    core = EngineCore(config, executor)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(Request(f"r{i}", p, sp, frozenset(), config.model_config.max_model_len,
                                 sampling_seed=1000 + i))
    tokens: dict[str, list[int]] = {}
    for out in run_until_idle(core):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    core.shutdown()
    return tokens


def test_seeded_sampling_and_penalties_are_the_same_with_pp_async_or_sync(llama_path):
    from raylm.runner.uniproc_executor import UniProcExecutor

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 19, 11, 7)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=1.0, presence_penalty=0.5, max_tokens=10,
                             ignore_eos=True),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, top_k=20, max_tokens=16,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, frequency_penalty=0.4, max_tokens=12,
                             ignore_eos=True)]
    single_config = EngineConfig(ModelConfig(model=llama_path),
                                 CacheConfig(block_size=4, num_kv_blocks=20),
                                 SchedulerConfig(async_scheduling=False, max_num_batched_tokens=16),
                                 ParallelConfig())
    single = _run_engine(single_config, UniProcExecutor(single_config), prompts, params)
    for async_scheduling in (False, True):
        config = _config(llama_path, 2, async_scheduling, max_num_batched_tokens=16)
        got = _run_engine(config, _BackToBackPipeline(config, 2), prompts, params)
        assert got == single, f"async_scheduling={async_scheduling}"


def test_ring_is_only_built_where_ids_must_come_back(llama_path):
    def runner(rank, async_scheduling):
        w = Worker(_config(llama_path, 2, async_scheduling), rank=rank)
        w.init_device(ParallelContext(tp_rank=0, tp_size=1, pp_rank=rank, pp_size=2, dp_rank=0,
                                      device=torch.device("cpu")), num_threads=1)
        return w.model_runner

    assert runner(0, True).pp_ring is not None
    assert runner(1, True).pp_ring is None  # the last stage samples
    assert runner(0, False).pp_ring is None  # sync: new_token_ids carry the inputs


def _spec_config(path, pp_size, async_scheduling, spec):
    return EngineConfig(ModelConfig(model=path), CacheConfig(block_size=4, num_kv_blocks=24),
                        SchedulerConfig(async_scheduling=async_scheduling, max_num_seqs=6,
                                        max_num_batched_tokens=16),
                        ParallelConfig(pipeline_parallel_size=pp_size),
                        speculative_config=SpeculativeConfig.from_dict(spec))


@pytest.mark.parametrize("method,pp_size", [("ngram", 2), ("ngram", 3), ("draft_model", 2),
                                            ("draft_model", 3)])
def test_speculation_with_async_pp_matches_transformers(loopy_llama_path, tmp_path, method,
                                                        pp_size):
    """Async PP with speculative decoding: the last stage broadcasts each request's accepted
    run, the ring delivers it pp_size steps later, and the earlier stages write it into
    their history before drafting the request's next step, so every stage proposes the
    same drafts and places them alike. Greedy tokens equal transformers and the sync run,
    with preemption, chunked prefill, and drafts both accepted and rejected."""
    from raylm.runner.loading.checkpoint import scale_attention_output

    path = loopy_llama_path
    if pp_size == 3:  # a stage per layer needs three layers
        path = write_random_checkpoint(str(tmp_path / "loopy3"),
                                       CheckpointSpec(num_hidden_layers=3, seed=2))
        scale_attention_output(path, 0.004)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        # A near copy: some drafts accepted, some rejected; positions priced high, so the
        # gate pauses after rejections (the draft KV past the accepted tokens must then
        # have been rolled back on every stage, or stage 0 would run other drafts).
        spec["draft_step_overhead_tokens"] = 0.2
        spec["model"] = str(tmp_path / "near")
        shutil.copytree(path, spec["model"])
        scale_attention_output(spec["model"], 4.0)
    rng = random.Random(5)
    passages = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 8, 5, 11, 4, 6)]
    prompts = [p * 3 for p in passages]
    max_tokens = [18, 12, 24, 10, 20, 16]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    runs = {}
    for async_scheduling in (False, True):
        config = _spec_config(path, pp_size, async_scheduling, spec)
        assert config.async_scheduling is async_scheduling
        executor = _BackToBackPipeline(config, pp_size)
        core = EngineCore(config, executor)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            core.add_request(Request(f"r{i}", p, sp, frozenset(),
                                     config.model_config.max_model_len, sampling_seed=i))
        tokens: dict[str, list[int]] = {}
        for out in run_until_idle(core):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        metrics = core.get_metrics()
        runs[async_scheduling] = tokens
        assert core.scheduler.counters.num_preemptions > 0
        assert executor.workers[0].model_runner.speculator.gate.decay == (
            PROMPT_LOOKUP_DECAY if method == "ngram" else DRAFTER_DECAY)
        drafted = metrics["raylm:spec_decode_num_draft_tokens"]
        assert 0 < metrics["raylm:spec_decode_num_accepted_tokens"] < drafted, {
            k: v for k, v in metrics.items() if "spec" in k}
        if async_scheduling:  # the runs came through the ring, 1 + 1 + k ids per row
            assert executor.hub.broadcasts and all(
                b.shape[1] == 5 for b in executor.hub.broadcasts)
            assert any((b[:, 0] > 1).any() for b in executor.hub.broadcasts)
        else:
            assert executor.hub.broadcasts == []
        core.shutdown()
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert runs[True][f"r{i}"] == hf_greedy(path, p, m), f"r{i}"
    assert runs[False] == runs[True]


def test_seeded_sampling_with_speculation_is_the_same_with_pp_async_or_sync(loopy_llama_path):
    """Sampled requests verify drafts by rejection sampling on the request's stateless
    RNG: with PP=2, async or sync, they give the tokens a single process gives."""
    from raylm.runner.uniproc_executor import UniProcExecutor

    rng = random.Random(8)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] * 3 for n in (4, 9, 6, 3)]
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.5, repetition_penalty=1.2, max_tokens=14,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    single_config = _spec_config(loopy_llama_path, 1, False, spec)
    single = _run_engine(single_config, UniProcExecutor(single_config), prompts, params)
    for async_scheduling in (False, True):
        config = _spec_config(loopy_llama_path, 2, async_scheduling, spec)
        got = _run_engine(config, _BackToBackPipeline(config, 2), prompts, params)
        assert got == single, f"async_scheduling={async_scheduling}"


@pytest.mark.parametrize("method,pp_size,async_scheduling", [
    ("eagle3", 2, False), ("eagle3", 2, True), ("eagle3", 3, False), ("eagle3", 3, True),
    ("eagle", 2, False)])
def test_draft_heads_under_pp_draft_the_heads_chain(
        llama_path, three_layer_path, loopy_llama_path, hf_oracle, monkeypatch, tmp_path,
        method, pp_size, async_scheduling):
    """A draft head on the last stage, sync and async. EAGLE-3 reads the inputs of three
    target layers (2 layers: 1, 1, 0; 3 layers: 2, 1, 0, one per stage): the earlier
    stages keep theirs and send them on with the hidden states. EAGLE-1: a head of the
    target's own layers on the loopy checkpoint, mostly accepted. The drafts reach the
    earlier stages with the last stage's broadcast in both modes (sync: the runs come from
    the scheduler), so every stage places the same drafts. Every proposal equals the
    head's own greedy chain computed by a plain-torch reference over transformers' hidden
    states (a feature taken from a wrong layer or stage changes them; EAGLE-3 only), and
    the tokens equal transformers, with preemption and chunked prefill."""
    from eagle_heads import (
        ReferenceHead,
        record_drafts,
        with_unit_final_norm,
        write_target_copy_head,
    )

    from raylm.runner.loading.eagle_checkpoint import write_eagle_head

    if method == "eagle":
        path = with_unit_final_norm(loopy_llama_path, str(tmp_path / "target"))
        head = write_target_copy_head(str(tmp_path / "head"), path)
    else:
        path = llama_path if pp_size == 2 else three_layer_path
        head = write_eagle_head(str(tmp_path / "head"), path, "eagle3")
    seen = record_drafts(monkeypatch)
    config = _spec_config(path, pp_size, async_scheduling, {
        "method": method, "model": head, "num_speculative_tokens": 3,
        "draft_step_overhead_tokens": 1e6})
    assert config.eagle_aux_layers == {"eagle": (), 2: (1, 1, 0), 3: (2, 1, 0)}[
        "eagle" if method == "eagle" else pp_size]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 21, 9, 30, 14, 6)]
    max_tokens = [18, 12, 24, 10, 20, 16]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    executor = _BackToBackPipeline(config, pp_size)
    core = EngineCore(config, executor)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(Request(f"r{i}", p, sp, frozenset(), config.model_config.max_model_len,
                                 sampling_seed=i))
    tokens: dict[str, list[int]] = {}
    for out in run_until_idle(core):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    metrics = core.get_metrics()
    assert core.scheduler.counters.num_preemptions > 0
    drafted = metrics["raylm:spec_decode_num_draft_tokens"]
    accepted = metrics["raylm:spec_decode_num_accepted_tokens"]
    assert drafted > 0 and (accepted > 0.5 * drafted if method == "eagle" else True), metrics
    assert executor.hub.broadcasts  # the runs and drafts went back in both modes
    assert all(w.model_runner.speculator.gate.decay == DRAFTER_DECAY for w in executor.workers)
    core.shutdown()
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert tokens[f"r{i}"] == hf_greedy(path, p, m), f"r{i}"
    assert len(seen) >= 20, len(seen)
    if method == "eagle":
        return  # the copy head (several layers) is checked by its acceptance above
    reference = ReferenceHead(head, hf_oracle(path).model, method)
    for history, drafts in seen:
        assert drafts == reference.drafts(history, len(drafts)), (
            f"after {len(history)} tokens the head proposed {drafts}")
