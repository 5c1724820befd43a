"""The ledger rules of docs/architecture.md §3 (their operations: scheduler/async_ledger.py),
each driven step by step through the Scheduler against the fake runner."""

from __future__ import annotations

import pytest
from engine_drive import run_until_idle
from sched_fake_executor import (
    EOS,
    FakeExecutor,
    FakeRunner,
    collect,
    expected_stream,
    expected_token,
    make_config,
    make_request,
)

from raylm.scheduler.async_scheduler import AsyncScheduler
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core_outputs import FinishReason, LogprobsLists, ModelRunnerOutput
from raylm.scheduler.request import RequestStatus
from raylm.scheduler.scheduler import Scheduler


def _run(engine: EngineCore, requests) -> list:
    for r in requests:
        engine.add_request(r)
    return run_until_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 16])
def test_rule1_2_exact_tokens_and_scheduled_count(n, async_scheduling):
    """max_tokens=N yields N tokens and exactly prompt + N - 1 scheduled tokens."""
    config = make_config(async_scheduling=async_scheduling, max_num_batched_tokens=8)
    executor = FakeExecutor()
    engine = EngineCore(config, executor)
    reqs = [make_request("solo", 7, max_tokens=n), make_request("long", 19, max_tokens=n + 3)]
    tokens, finals = collect(_run(engine, reqs))
    runner = executor.runner
    for r in reqs:
        assert tokens[r.request_id] == expected_stream(r)
        assert [o.finish_reason for o in finals[r.request_id]] == [FinishReason.LENGTH]
        assert runner.scheduled_tokens[r.request_id] == r.num_prompt_tokens + r.max_tokens - 1
        assert runner.num_sampled[r.request_id] == r.max_tokens  # no step without a token


def _step(sched, runner, so=None):
    so = so or sched.schedule()
    return so, runner.execute(so)


def _sched(async_scheduling: bool, **kw):
    config = make_config(async_scheduling=async_scheduling, **kw)
    cls = AsyncScheduler if async_scheduling else Scheduler
    num_blocks = kw.get("num_kv_blocks") or 64
    return cls(config, num_blocks), FakeRunner(num_blocks, config.cache_config.block_size)


def test_rule1_placeholders_booked_and_settled():
    sched, runner = _sched(True)
    r = make_request("a", 6, max_tokens=10)
    sched.add_request(r)
    so1, out1 = _step(sched, runner)
    assert r.num_output_placeholders == 1 and r.num_computed_tokens == 6
    so2, out2 = _step(sched, runner)  # planned while step 1 is "in flight"
    assert so2.num_scheduled_tokens == {"a": 1}
    assert r.num_output_placeholders == 2 and r.num_in_flight_tokens == 7
    sched.update_from_output(so1, out1)
    assert r.num_output_placeholders == 1 and r.num_output_tokens == 1
    assert r.num_computed_tokens == r.num_tokens + r.num_output_placeholders - 1
    sched.update_from_output(so2, out2)
    assert r.num_output_placeholders == 0 and r.num_in_flight_tokens == 0
    sched.check_integrity(no_steps_in_flight=True)


def test_rule1_placeholders_settled_including_trimmed_at_stop():
    """Two tokens returned for one request, the first is EOS: both placeholders settle."""
    sched, runner = _sched(True)
    r = make_request("a", 6, max_tokens=10, ignore_eos=False, logprobs=1)
    sched.add_request(r)
    so, _ = _step(sched, runner)
    r.num_output_placeholders += 1  # as if a draft had been booked too
    r.num_computed_tokens += 1
    lp = LogprobsLists([[EOS, 5], [99, 5]], [[-0.1, -2.0], [-0.3, -1.0]], [1, 1])
    fake = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0},
                             sampled_token_ids=[[EOS, 99]], logprobs=[lp])
    outs = sched.update_from_output(so, fake)
    assert outs.outputs[0].new_token_ids == [EOS]
    assert outs.outputs[0].new_logprobs == LogprobsLists([[EOS, 5]], [[-0.1, -2.0]], [1])
    assert outs.outputs[0].finish_reason == FinishReason.STOP
    assert r.num_output_placeholders == 0
    assert r.num_computed_tokens == 6  # trimmed token rolled back: all known but the last


def test_rule2_no_step_for_a_finished_max_tokens():
    sched, runner = _sched(True)
    r = make_request("a", 5, max_tokens=1)
    sched.add_request(r)
    so1, out1 = _step(sched, runner)
    so2 = sched.schedule()
    assert so2.is_empty  # the prefill's token is the only one
    sched.update_from_output(so1, out1)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rule3_rejected_drafts_roll_back(async_scheduling):
    sched, runner = _sched(async_scheduling, num_spec_tokens=3)
    r = make_request("a", 8, max_tokens=20)
    sched.add_request(r)
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"a": 8} and not so1.scheduled_spec_decode_tokens
    if async_scheduling:  # step 2 is booked before step 1 is back
        so2 = sched.schedule()
        sched.update_from_output(so1, runner.execute(so1))
    else:
        sched.update_from_output(so1, runner.execute(so1))
        so2 = sched.schedule()
    assert r.num_tokens == 9
    # The decode carries the last token and 3 drafts, booked as -1 for the worker to fill.
    assert so2.num_scheduled_tokens == {"a": 4}
    assert so2.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    assert r.num_computed_tokens == 12
    assert r.num_output_placeholders == (4 if async_scheduling else 0)
    # One draft accepted plus the bonus token: two drafts rejected.
    fake = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[11, 50]])
    outs = sched.update_from_output(so2, fake)
    assert outs.outputs[0].new_token_ids == [11, 50]
    assert r.num_tokens == 11
    assert r.num_computed_tokens == 10  # every known token but the last
    assert r.num_output_placeholders == 0
    assert r.num_in_flight_tokens == 0
    stats = sched.spec_decode_counters
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 7])
def test_drafts_never_past_max_tokens(async_scheduling, max_tokens):
    """A decode books only the drafts that could still be emitted (vLLM's _drafts_unused),
    and every draft accepted still yields exactly max_tokens."""
    config = make_config(async_scheduling=async_scheduling, num_spec_tokens=5)
    executor = FakeExecutor()
    engine = EngineCore(config, executor)
    r = make_request("a", 6, max_tokens=max_tokens)
    tokens, finals = collect(_run(engine, [r]))
    assert tokens["a"] == expected_stream(r)
    assert [o.finish_reason for o in finals["a"]] == [FinishReason.LENGTH]
    scheduled = executor.runner.scheduled_tokens["a"]
    if async_scheduling:
        # The scheduler counts on at least one token from the step in flight; when that
        # step accepts all its drafts, the next one's drafts may run past max_tokens.
        assert scheduled <= r.num_prompt_tokens + max_tokens - 1 + 5
    else:
        # Sync: it knows every output, so no booked draft is wasted.
        assert scheduled == r.num_prompt_tokens + max_tokens - 1


def test_rule4_stale_outputs_drained_never_appended():
    # 4 blocks of 4 tokens: two 8-token prompts fill the pool; the first decode preempts.
    sched, runner = _sched(True, num_kv_blocks=4, max_num_batched_tokens=64)
    a, b = make_request("a", 8, max_tokens=3), make_request("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    so1, out1 = _step(sched, runner)
    so2, out2 = _step(sched, runner)  # a needs a block: b (newest) is preempted
    assert so2.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    assert b.num_stale_output_tokens == 8 and b.num_in_flight_tokens == 8
    assert b.num_computed_tokens == 0 and b.num_output_placeholders == 0
    assert b.num_preemptions == 1
    outs1 = sched.update_from_output(so1, out1)
    assert {o.request_id for o in outs1.outputs} == {"a"}  # b's token is stale
    assert b.num_output_tokens == 0 and b.num_stale_output_tokens == 0
    assert b.num_in_flight_tokens == 0
    sched.update_from_output(so2, out2)
    sched.check_integrity()
    # Run to the end: b resumes from scratch and produces exactly its stream.
    pending, all_outs = [], list(outs1.outputs)
    while sched.has_requests() or pending:
        if sched.has_requests():
            so = sched.schedule()
            pending.append((so, runner.execute(so)))
        if len(pending) == 2 or not sched.has_requests():
            all_outs += sched.update_from_output(*pending.pop(0)).outputs
        sched.check_integrity()
    tokens, finals = collect(all_outs)
    assert tokens == {"a": expected_stream(a), "b": expected_stream(b)}
    assert all(len(v) == 1 for v in finals.values())
    sched.check_integrity(no_steps_in_flight=True)


def _free_ids(sched):
    pool = sched.kv_cache_manager.block_pool
    return {i for i in range(pool.num_blocks) if pool.is_free(i)}


def test_rule5_abort_in_flight_skipped_and_freed_after_fence():
    sched, runner = _sched(True)
    r = make_request("a", 10, max_tokens=5)
    sched.add_request(r)
    so1, out1 = _step(sched, runner)
    block_ids = sched.kv_cache_manager.get_block_ids("a")
    outs = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ABORT)]
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []  # once only
    assert not set(block_ids) & _free_ids(sched)  # step 1 may still write them
    result = sched.update_from_output(so1, out1)
    assert result.outputs == []  # skipped on return
    assert set(block_ids) <= _free_ids(sched)
    so2 = sched.schedule()
    assert so2.finished_req_ids == {"a"} and so2.is_empty
    sched.check_integrity(no_steps_in_flight=True)


def test_rule5_finish_with_a_step_in_flight_frees_after_that_step():
    sched, runner = _sched(True)
    runner.eos_at["a"] = 0
    r = make_request("a", 10, max_tokens=5, ignore_eos=False)
    sched.add_request(r)
    so1, out1 = _step(sched, runner)
    so2, out2 = _step(sched, runner)  # a decode booked before EOS is known
    block_ids = sched.kv_cache_manager.get_block_ids("a")
    outs = sched.update_from_output(so1, out1)
    assert outs.outputs[0].finish_reason == FinishReason.STOP
    assert outs.outputs[0].new_token_ids == [EOS]
    assert not set(block_ids) & _free_ids(sched)  # step 2 still writes them
    assert sched.update_from_output(so2, out2).outputs == []
    assert set(block_ids) <= _free_ids(sched)
    sched.check_integrity(no_steps_in_flight=True)


def test_sync_preemption_frees_at_once():
    sched, runner = _sched(False, num_kv_blocks=4)
    a, b = make_request("a", 8, max_tokens=3), make_request("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    so1, out1 = _step(sched, runner)
    sched.update_from_output(so1, out1)
    so2 = sched.schedule()
    assert so2.preempted_req_ids == {"b"} and so2.num_scheduled_tokens == {"a": 1}
    assert b.num_stale_output_tokens == 0
    sched.check_integrity()


def test_pp_decode_cadence():
    config = make_config(async_scheduling=True, pipeline_parallel_size=2)
    executor = FakeExecutor()
    engine = EngineCore(config, executor)
    assert engine.batch_queue_size == 3
    r = make_request("a", 5, max_tokens=6)
    tokens, _ = collect(_run(engine, [r]))
    assert tokens["a"] == expected_stream(r)
    steps = [so.step_id for so in executor.history if "a" in so.num_scheduled_tokens]
    assert all(b - a >= 2 for a, b in zip(steps, steps[1:])), steps
    assert steps[1] - steps[0] == 2  # eligible again exactly pp steps later
    assert expected_token("a", 5) == tokens["a"][0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pp_new_token_ids_only_in_sync_mode(async_scheduling):
    """Sync PP: each decode step carries the sampled id it consumes (earlier stages never
    sampled it). Async PP broadcasts ids between stages, so the lists stay empty."""
    config = make_config(async_scheduling=async_scheduling, pipeline_parallel_size=2)
    executor = FakeExecutor()
    engine = EngineCore(config, executor)
    r = make_request("a", 5, max_tokens=4)
    tokens, _ = collect(_run(engine, [r]))
    sent = [ids for so in executor.history for ids in so.scheduled_cached_reqs.new_token_ids]
    if async_scheduling:
        assert all(ids == [] for ids in sent)
    else:
        assert [t for ids in sent for t in ids] == tokens["a"][:-1]  # each input once


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_draft_model_books_kv_slots_ahead_within_max_model_len(tmp_path, async_scheduling):
    """A draft model (no PP) writes its KV for the next step's drafts right after
    verification, up to k positions past the step's tokens: the scheduler books those
    slots with the step, never past max_model_len, and counts them when it checks that a
    request can fit the pool at all."""
    from dataclasses import replace

    from raylm.scheduler.config.engine_config import ParallelConfig
    from raylm.scheduler.config.speculative_config import SpeculativeConfig
    from raylm.scheduler.request import InvalidRequestError

    (tmp_path / "config.json").write_text('{"vocab_size": 1000}')
    k, bs, max_model_len = 3, 4, 20
    config = replace(make_config(async_scheduling=async_scheduling, block_size=bs,
                                 max_model_len=max_model_len),
                     speculative_config=SpeculativeConfig("draft_model", k, model=str(tmp_path)))
    assert config.num_lookahead_tokens == k
    assert replace(config, parallel_config=ParallelConfig(pipeline_parallel_size=2)
                   ).num_lookahead_tokens == 0  # PP stages draft inside the step's booking
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched, runner = cls(config, 64), FakeRunner(64, bs)
    r = make_request("a", 6, max_tokens=12, max_model_len=max_model_len)
    sched.add_request(r)
    held = []
    in_flight = []
    while sched.has_unfinished_requests() or in_flight:
        if sched.has_unfinished_requests():
            so = sched.schedule()
            if so.total_num_scheduled_tokens:
                held.append(len(sched.kv_cache_manager.req_to_blocks["a"]))
                in_flight.append((so, runner.execute(so)))
        if in_flight and (not async_scheduling or len(in_flight) > 1
                          or not sched.has_unfinished_requests()):
            sched.update_from_output(*in_flight.pop(0))
    assert held[0] == -(-(6 + k) // bs)  # the prompt's 2 blocks and one ahead
    assert max(held) == max_model_len // bs  # 6 + 12 tokens + 3 ahead, capped at 20
    assert r.num_output_tokens == 12
    sched.check_integrity(no_steps_in_flight=True)
    # 6 + 10 tokens fit 4 blocks of 4; with the draft slots past them they need 5.
    cls(replace(config, speculative_config=None), 4).add_request(
        make_request("b", 6, max_tokens=10, max_model_len=max_model_len))
    with pytest.raises(InvalidRequestError, match=f"{k} draft slots"):
        cls(config, 4).add_request(make_request("b", 6, max_tokens=10,
                                                max_model_len=max_model_len))
