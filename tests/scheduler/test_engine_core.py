"""EngineCore loops against the fake executor: sync vs async identity, aborts, failures."""

from __future__ import annotations

import threading

import pytest
from engine_drive import run_until_idle
from sched_fake_executor import (
    FakeExecutor,
    collect,
    expected_stream,
    make_config,
    make_request,
    prompt_tokens,
)

from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import FinishReason


def _workload():
    shared = prompt_tokens("shared", 24)
    reqs = []
    for i in range(10):
        if i % 3 == 0:
            prompt = shared + prompt_tokens(f"tail{i}", 3 + i)  # prefix-cache hits
        else:
            prompt = prompt_tokens(f"p{i}", 5 + 7 * i)  # long ones are chunked
        reqs.append(make_request(f"r{i}", prompt, max_tokens=3 + (i * 5) % 17))
    return reqs


def _run(async_scheduling: bool, num_blocks: int, mode: str = "lazy", **kw):
    config = make_config(async_scheduling=async_scheduling, num_kv_blocks=num_blocks,
                         max_num_batched_tokens=16, max_num_seqs=6, **kw)
    executor = FakeExecutor(num_blocks=num_blocks, mode=mode)
    engine = EngineCore(config, executor)
    reqs = _workload()
    # Half now, half after a few steps (prefix hits need the first ones settled).
    for r in reqs[:5]:
        engine.add_request(r)
    outputs = []
    for _ in range(6):
        out, _ = engine.step_fn()
        if out is not None:
            outputs += out.outputs
    for r in reqs[5:]:
        engine.add_request(r)
    outputs += run_until_idle(engine)
    return reqs, outputs, engine, executor


@pytest.mark.parametrize("num_blocks", [200, 24])
def test_sync_and_async_streams_identical(num_blocks):
    streams = {}
    for async_scheduling in (False, True):
        reqs, outputs, engine, executor = _run(async_scheduling, num_blocks)
        tokens, finals = collect(outputs)
        for r in reqs:
            assert tokens[r.request_id] == expected_stream(r), r.request_id
            assert len(finals[r.request_id]) == 1
            cached = finals[r.request_id][0].num_cached_tokens
            assert cached % 4 == 0 and cached == r.num_cached_tokens
            assert r.num_prompt_tokens + r.max_tokens - 1 - cached <= (
                executor.runner.scheduled_tokens[r.request_id])
        metrics = engine.get_metrics()
        assert metrics["raylm:generation_tokens"] == sum(r.max_tokens for r in reqs)
        assert metrics["raylm:prompt_tokens"] == sum(r.num_prompt_tokens for r in reqs)
        assert metrics["raylm:prefix_cache_hits"] > 0
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0
        if num_blocks == 24:
            assert metrics["raylm:num_preemptions"] > 0, async_scheduling
        else:
            assert metrics["raylm:num_preemptions"] == 0
            for r in reqs:  # no preemption: exactly prompt + N - 1 - hits scheduled
                assert executor.runner.scheduled_tokens[r.request_id] == (
                    r.num_prompt_tokens + r.max_tokens - 1 - r.num_cached_tokens)
        # Chunked prefill happened: some step scheduled part of a prompt.
        assert any(0 < n < 16 and so.num_scheduled_tokens.get(rid) for so in executor.history
                   for rid, n in so.num_scheduled_tokens.items()) and max(
            so.total_num_scheduled_tokens for so in executor.history) <= 16
        engine.scheduler.check_integrity(no_steps_in_flight=True)
        streams[async_scheduling] = tokens
    assert streams[False] == streams[True]


def test_threaded_executor_same_streams():
    reqs, outputs, engine, executor = _run(True, 24, mode="thread")
    tokens, finals = collect(outputs)
    assert all(tokens[r.request_id] == expected_stream(r) for r in reqs)
    engine.shutdown()
    assert executor.shut_down


def test_batch_queue_does_not_block_while_it_has_room():
    config = make_config(async_scheduling=True)
    executor = FakeExecutor()
    engine = EngineCore(config, executor)
    assert engine.step_fn == engine.step_with_batch_queue and engine.batch_queue_size == 2
    engine.add_request(make_request("a", 6, max_tokens=4))
    out, executed = engine.step_fn()
    assert out is None and executed and len(executor.pending) == 1  # step 1 not awaited
    out, executed = engine.step_fn()  # plans step 2, then blocks on step 1 only
    assert [o.new_token_ids for o in out.outputs] == [expected_stream(
        make_request("a", 6, max_tokens=4))[:1]]
    assert len(executor.pending) == 1 and executor.pending[0][1].step_id == 2


def test_sync_engine_uses_step():
    engine = EngineCore(make_config(async_scheduling=False), FakeExecutor())
    assert engine.step_fn == engine.step and engine.batch_queue_size == 1


def test_empty_steps_not_sent_without_pp():
    reqs, outputs, engine, executor = _run(True, 200)
    for so in executor.history:
        assert not so.is_empty or so.finished_req_ids or so.preempted_req_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_racing_the_final_token(async_scheduling):
    config = make_config(async_scheduling=async_scheduling)
    executor = FakeExecutor()
    engine = EngineCore(config, executor)
    engine.add_request(make_request("a", 6, max_tokens=2))
    engine.add_request(make_request("b", 6, max_tokens=2))
    outputs = []
    out, _ = engine.step_fn()  # prefill (async: in flight)
    outputs += out.outputs if out else []
    if async_scheduling:
        out, _ = engine.step_fn()  # plans the final decode, settles the prefill
        outputs += out.outputs
        assert len(executor.pending) == 1  # a's final token is in flight
    engine.abort_requests(["a"])
    outputs += run_until_idle(engine)
    tokens, finals = collect(outputs)
    assert [o.finish_reason for o in finals["a"]] == [FinishReason.ABORT]
    assert len(tokens["a"]) == 1
    assert [o.finish_reason for o in finals["b"]] == [FinishReason.LENGTH]
    engine.abort_requests(["a", "b", "unknown"])  # after the end: no second final output
    assert run_until_idle(engine) == []
    engine.scheduler.check_integrity(no_steps_in_flight=True)
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_abort_from_another_thread():
    config = make_config(async_scheduling=True, max_num_batched_tokens=16)
    executor = FakeExecutor(mode="thread", step_time=0.001)
    engine = EngineCore(config, executor)
    reqs = [make_request(f"r{i}", 10, max_tokens=40) for i in range(6)]
    for r in reqs:
        engine.add_request(r)
    aborter = threading.Timer(0.02, engine.abort_requests, args=(["r1", "r4"],))
    aborter.start()
    outputs = run_until_idle(engine)
    aborter.join()
    tokens, finals = collect(outputs)
    for r in reqs:
        assert len(finals[r.request_id]) == 1
        assert tokens.get(r.request_id, []) == expected_stream(r)[:len(tokens.get(r.request_id, []))]
    engine.shutdown()


def test_executor_failure_aborts_everything_and_raises():
    config = make_config(async_scheduling=True)
    executor = FakeExecutor(fail_at_step=3)
    engine = EngineCore(config, executor)
    for i in range(3):
        engine.add_request(make_request(f"r{i}", 6, max_tokens=10))
    with pytest.raises(EngineDeadError, match="fake device fault at step 3") as info:
        run_until_idle(engine)
    finals = info.value.outputs.outputs
    assert sorted(o.request_id for o in finals) == ["r0", "r1", "r2"]
    assert all(o.finish_reason == FinishReason.ABORT for o in finals)
    with pytest.raises(EngineDeadError, match="fake device fault"):
        engine.step_fn()
    with pytest.raises(EngineDeadError):
        engine.add_request(make_request("late", 4))


def test_add_request_validation():
    config = make_config(async_scheduling=True, num_kv_blocks=8, block_size=4)
    engine = EngineCore(config, FakeExecutor(num_blocks=64))
    assert engine.num_kv_blocks == 8  # the explicit pool size caps the executor's
    with pytest.raises(ValueError, match=r"needs 9 KV blocks .* pool holds only 8"):
        engine.add_request(make_request("big", 20, max_tokens=16))
    engine.add_request(make_request("ok", 20, max_tokens=12))
    with pytest.raises(ValueError, match="'ok' is already in use"):
        engine.add_request(make_request("ok", 3))
    tokens, finals = collect(run_until_idle(engine))
    assert len(tokens["ok"]) == 12


def test_idle_engine_checks_integrity(monkeypatch):
    engine = EngineCore(make_config(async_scheduling=True), FakeExecutor())
    calls = []
    original = engine.scheduler.check_integrity
    monkeypatch.setattr(engine.scheduler, "check_integrity",
                        lambda **kw: (calls.append(kw), original(**kw)))
    engine.add_request(make_request("a", 5, max_tokens=3))
    run_until_idle(engine)
    assert calls and calls[-1] == {"no_steps_in_flight": True}


class _BlockingExecutor(FakeExecutor):
    """An executor whose execute_model returns the output itself (cannot overlap)."""

    supports_async_scheduling = False

    def execute_model(self, scheduler_output, non_block=False):
        return super().execute_model(scheduler_output, non_block=False)


def test_blocking_executor_result_is_wrapped():
    engine = EngineCore(make_config(async_scheduling=True), _BlockingExecutor())
    r = make_request("a", 6, max_tokens=5)
    engine.add_request(r)
    tokens, finals = collect(run_until_idle(engine))
    assert tokens["a"] == expected_stream(r)


def test_scheduler_stats_deltas_add_up_to_counters():
    config = make_config(async_scheduling=True, num_kv_blocks=24, max_num_batched_tokens=16,
                         max_num_seqs=6)
    engine = EngineCore(config, FakeExecutor(num_blocks=24))
    for r in _workload():
        engine.add_request(r)
    preemptions = hits = queries = 0
    while engine.has_work():
        out, _ = engine.step_fn()
        if out is not None and out.scheduler_stats is not None:
            stats = out.scheduler_stats
            assert 0.0 <= stats.kv_cache_usage <= 1.0
            assert stats.num_running_reqs <= 6
            preemptions += stats.num_preemptions
            hits += stats.prefix_cache_hits
            queries += stats.prefix_cache_queries
    m = engine.get_metrics()
    assert preemptions == m["raylm:num_preemptions"] > 0
    assert hits == m["raylm:prefix_cache_hits"] > 0
    assert queries == m["raylm:prefix_cache_queries"] >= hits
    assert m["raylm:request_success"] == 10
    assert m["raylm:num_requests_running"] == m["raylm:num_requests_waiting"] == 0


class _MuteExecutor(FakeExecutor):
    """A broken runner that never samples: the engine must not spin forever."""

    def _run(self, so):
        out = super()._run(so)
        out.sampled_token_ids = [[] for _ in out.sampled_token_ids]
        return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_progress_is_an_error_not_a_spin(async_scheduling):
    # Async keeps booking decodes against tokens that never come until max_model_len caps
    # the request; then, as in sync mode at once, nothing can be scheduled: an error.
    config = make_config(async_scheduling=async_scheduling, max_model_len=32)
    engine = EngineCore(config, _MuteExecutor())
    engine.add_request(make_request("a", 6, max_tokens=5, max_model_len=32))
    with pytest.raises(RuntimeError, match="made no progress with nothing in flight"):
        run_until_idle(engine, max_steps=200)
