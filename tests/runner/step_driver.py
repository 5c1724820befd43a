"""A minimal hand-written scheduler for driving the runner in tests.

It builds SchedulerOutput diffs the way the real scheduler does (new requests once,
then CachedRequestData; chunked prefill; shuffled block ids; async placeholders booked at
schedule time and settled when outputs arrive), without any of its policies.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from raylm.scheduler.core_outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from raylm.scheduler.sampling_params import SamplingParams


@dataclass
class DriverRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    chunk_size: int
    outputs: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    num_computed: int = 0
    placeholders: int = 0
    block_ids: list[int] = field(default_factory=list)
    sent: bool = False
    finished: bool = False
    skip_steps: set[int] = field(default_factory=set)  # steps in which it is not scheduled

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens


class StepDriver:
    def __init__(self, runner, block_size: int, num_blocks: int, async_mode: bool,
                 seed: int = 0, send_token_ids: bool = False) -> None:
        self.runner = runner
        # Sync pipeline parallelism: the scheduler sends the output ids among each step's
        # inputs, because earlier stages never sample them.
        self.send_token_ids = send_token_ids
        self.block_size = block_size
        self.async_mode = async_mode
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)  # non-trivial block tables
        self.free_blocks = free
        self.requests: dict[str, DriverRequest] = {}
        self.step_id = 0
        self._finished: set[str] = set()

    def add(self, req_id: str, prompt: list[int], params: SamplingParams, seed: int = 0,
            chunk_size: int = 1 << 30, skip_steps: set[int] | None = None) -> DriverRequest:
        req = DriverRequest(req_id, list(prompt), params, seed, chunk_size,
                            skip_steps=set(skip_steps or ()))
        self.requests[req_id] = req
        return req

    def _active(self) -> list[DriverRequest]:
        return [r for r in self.requests.values() if not r.finished]

    def schedule(self) -> SchedulerOutput:
        new, cached = [], CachedRequestData()
        num_scheduled: dict[str, int] = {}
        for req in self._active():
            if self.step_id in req.skip_steps:
                continue
            prompt_len = len(req.prompt)
            if req.num_computed < prompt_len:
                n = min(req.chunk_size, prompt_len - req.num_computed)
                samples = req.num_computed + n == prompt_len
            else:
                # Decode: only if it can still produce a token (docs/architecture.md §3 rule 2), and in sync
                # mode only once the previous token is known.
                if len(req.outputs) + req.placeholders >= req.max_tokens:
                    continue
                if not self.async_mode and req.num_computed >= prompt_len + len(req.outputs):
                    continue
                n, samples = 1, True
            if samples and len(req.outputs) + req.placeholders >= req.max_tokens:
                continue
            end = req.num_computed + n
            need = -(-end // self.block_size) - len(req.block_ids)
            new_blocks = [self.free_blocks.pop() for _ in range(max(need, 0))]
            req.block_ids += new_blocks
            if not req.sent:
                new.append(NewRequestData(req.req_id, req.prompt, [], req.params,
                                          list(req.block_ids), req.num_computed, req.seed))
                req.sent = True
            else:
                cached.req_ids.append(req.req_id)
                cached.new_block_ids.append(new_blocks)
                cached.num_computed_tokens.append(req.num_computed)
                start = max(req.num_computed, prompt_len)
                all_ids = req.prompt + req.outputs
                cached.new_token_ids.append(
                    all_ids[start:req.num_computed + n] if self.send_token_ids else [])
            num_scheduled[req.req_id] = n
            req.num_computed = end
            if samples and self.async_mode:
                req.placeholders += 1
        so = SchedulerOutput(step_id=self.step_id, scheduled_new_reqs=new,
                             scheduled_cached_reqs=cached, num_scheduled_tokens=num_scheduled,
                             total_num_scheduled_tokens=sum(num_scheduled.values()),
                             finished_req_ids=set(self._finished))
        self._finished.clear()
        self.step_id += 1
        return so

    def abort(self, req_id: str) -> None:
        """Finish a request now, even with a step in flight for it (its output is then
        skipped when it arrives)."""
        req = self.requests[req_id]
        req.finished = True
        self.free_blocks += req.block_ids
        self._finished.add(req_id)

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        for req_id, index in out.req_id_to_index.items():
            req = self.requests[req_id]
            tokens = out.sampled_token_ids[index]
            if self.async_mode:
                req.placeholders -= len(tokens)
                assert req.placeholders >= 0
            if req.finished:
                continue  # finished while this step was in flight
            req.outputs += tokens
            if tokens and out.logprobs is not None and out.logprobs[index] is not None:
                req.logprobs.append(out.logprobs[index])
            if len(req.outputs) >= req.max_tokens:
                req.finished = True
                self.free_blocks += req.block_ids
                self._finished.add(req_id)

    def run(self, max_steps: int = 1000) -> dict[str, list[int]]:
        """Run to completion; async mode keeps one step in flight (get_output is called
        only after the next step has been submitted)."""
        in_flight: deque = deque()
        for _ in range(max_steps):
            if not self._active() and not in_flight:
                break
            if self._active():
                so = self.schedule()
                in_flight.append((so, self.runner.execute_model(so)))
                if self.async_mode and len(in_flight) < 2:
                    continue
            done_so, done = in_flight.popleft()
            if hasattr(done, "get_output"):
                done = done.get_output()
            self.update(done_so, done)
        else:
            raise AssertionError("driver did not finish")
        return {r.req_id: r.outputs for r in self.requests.values()}
