"""The PP decode cadence (docs/architecture.md §4) through the real EngineCore and a fake executor:
with pp_size P a request never samples twice within P scheduled steps (its token takes P
steps to come back to the first stage), exactly P apart when nothing else holds it back;
non-final prefill chunks go in consecutive steps; pp + 1 batches in flight with async
scheduling, pp without; every step, empty ones included, reaches the workers."""

from __future__ import annotations

import collections

import pytest
from sched_fake_executor import (
    FakeExecutor,
    collect,
    expected_stream,
    make_config,
    make_request,
)

from raylm.scheduler.core.engine_core import EngineCore

ASYNC = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


class _Recorder:
    """Which requests sampled in which step, per incarnation (a preemption or a re-send
    starts a new one: its first token comes from a prefill, not from the ring)."""

    def __init__(self, executor: FakeExecutor) -> None:
        self.executor = executor
        self.samples: dict[str, list[list[int]]] = collections.defaultdict(lambda: [[]])
        self.chunks: dict[str, list[int]] = collections.defaultdict(list)  # non-sampling steps
        self.step_ids: list[int] = []
        self.max_in_flight = 0

    def install(self) -> None:
        runner = self.executor.runner
        execute = runner.execute

        def recording_execute(so):
            out = execute(so)
            self.step_ids.append(so.step_id)
            for rid in so.preempted_req_ids | {n.req_id for n in so.scheduled_new_reqs}:
                if self.samples[rid][-1]:
                    self.samples[rid].append([])
            for rid, i in out.req_id_to_index.items():
                if out.sampled_token_ids[i]:
                    self.samples[rid][-1].append(so.step_id)
                else:
                    self.chunks[rid].append(so.step_id)
            return out

        runner.execute = recording_execute


def _run(config, executor, requests) -> tuple[EngineCore, _Recorder, dict[str, list[int]]]:
    engine = EngineCore(config, executor)
    rec = _Recorder(executor)
    rec.install()
    submit = executor.execute_model

    def counting_submit(so, non_block=False):
        rec.max_in_flight = max(rec.max_in_flight, len(engine.batch_queue) + 1)
        return submit(so, non_block)

    executor.execute_model = counting_submit
    for r in requests:
        engine.add_request(r)
    outputs = []
    while engine.has_work():
        out, _ = engine.step_fn()
        if out is not None:
            outputs.extend(out.outputs)
    tokens, _ = collect(outputs)
    return engine, rec, tokens


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("pp_size", [2, 3, 4])
def test_no_request_samples_twice_within_pp_steps(pp_size, async_scheduling):
    config = make_config(async_scheduling=async_scheduling, pipeline_parallel_size=pp_size,
                         max_num_batched_tokens=10, num_kv_blocks=24, max_num_seqs=6)
    executor = FakeExecutor(num_blocks=24)
    reqs = [make_request(f"r{i}", n, max_tokens=m)
            for i, (n, m) in enumerate([(3, 14), (17, 9), (6, 20), (25, 7), (9, 12), (4, 16)])]
    engine, rec, tokens = _run(config, executor, reqs)
    assert engine.batch_queue_size == pp_size + (1 if async_scheduling else 0)
    assert rec.max_in_flight == engine.batch_queue_size  # the pipeline really fills
    assert engine.scheduler.counters.num_preemptions > 0  # 24 blocks: some recompute
    for r in reqs:
        assert tokens[r.request_id] == expected_stream(r)
        for incarnation in rec.samples[r.request_id]:
            gaps = [b - a for a, b in zip(incarnation, incarnation[1:])]
            assert all(g >= pp_size for g in gaps), (r.request_id, incarnation)
    # Every scheduled step reached the workers (empty ones too: they advance the ring).
    assert rec.step_ids == list(range(1, engine.scheduler.current_step + 1))


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("pp_size", [2, 3])
def test_a_lone_request_decodes_exactly_every_pp_steps(pp_size, async_scheduling):
    config = make_config(async_scheduling=async_scheduling, pipeline_parallel_size=pp_size)
    executor = FakeExecutor()
    r = make_request("solo", 5, max_tokens=6)
    _, rec, tokens = _run(config, executor, [r])
    assert tokens["solo"] == expected_stream(r)
    [steps] = rec.samples["solo"]
    assert [b - a for a, b in zip(steps, steps[1:])] == [pp_size] * 5, steps


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_prefill_chunks_are_not_staggered(async_scheduling):
    pp_size = 3
    config = make_config(async_scheduling=async_scheduling, pipeline_parallel_size=pp_size,
                         max_num_batched_tokens=8)
    executor = FakeExecutor()
    # Two short requests decode (1 token per step each) while a 40-token prompt is chunked
    # into the rest of the budget: its chunks go in consecutive steps.
    reqs = [make_request("a", 3, max_tokens=30), make_request("b", 2, max_tokens=30),
            make_request("long", 40, max_tokens=4)]
    _, rec, tokens = _run(config, executor, reqs)
    for r in reqs:
        assert tokens[r.request_id] == expected_stream(r)
    chunks = rec.chunks["long"]
    first_sample = rec.samples["long"][0][0]
    assert len(chunks) >= 4
    assert chunks + [first_sample] == list(range(chunks[0], first_sample + 1)), (chunks,
                                                                                  first_sample)


def test_async_scheduling_defaults_to_on_with_pp():
    config = make_config(async_scheduling=None, pipeline_parallel_size=2)
    assert config.async_scheduling and config.max_concurrent_batches == 3
    engine = EngineCore(config, FakeExecutor())
    assert type(engine.scheduler).__name__ == "AsyncScheduler"
    assert engine.scheduler.decode_stagger == 2 and engine.batch_queue_size == 3
