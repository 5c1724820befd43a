"""Every stop condition, through check_stop and through the engine in both modes."""

from __future__ import annotations

import pytest
from engine_drive import run_until_idle
from sched_fake_executor import (
    EOS,
    FakeExecutor,
    collect,
    expected_stream,
    expected_token,
    make_config,
    make_request,
)

from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core_outputs import FinishReason
from raylm.scheduler.request import Request, RequestStatus
from raylm.scheduler.sampling_params import SamplingParams
from raylm.scheduler.stop import check_stop


def _req(max_tokens=5, max_model_len=64, **kw) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **kw)
    return Request("r", [5, 6, 7], sp, frozenset({EOS}), max_model_len, sampling_seed=0)


def _push(r: Request, tok: int, max_model_len: int = 64) -> bool:
    r.append_output_token_ids(tok)
    return check_stop(r, max_model_len)


def test_check_stop_eos_and_ignore_eos():
    r = _req()
    assert not _push(r, 11)
    assert _push(r, EOS)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    r = _req(ignore_eos=True)
    assert not _push(r, EOS)


def test_check_stop_stop_token_ids_sets_stop_reason():
    r = _req(stop_token_ids=[42])
    assert not _push(r, 41)
    assert _push(r, 42)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert r.get_finished_reason() == FinishReason.STOP


def test_check_stop_min_tokens_gates_eos_and_stop_ids():
    r = _req(min_tokens=2, stop_token_ids=[42])
    assert not _push(r, EOS)
    assert _push(r, 42)  # the second token reaches min_tokens
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42


def test_check_stop_length_first():
    r = _req(max_tokens=2)
    assert not _push(r, 11)
    assert _push(r, EOS)  # at max_tokens: capped even though it is EOS (as vLLM)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.get_finished_reason() == FinishReason.LENGTH


def test_check_stop_max_model_len():
    r = _req(max_tokens=None, max_model_len=6)
    assert r.max_tokens == 3
    assert not _push(r, 11, 6) and not _push(r, 12, 6)
    assert _push(r, 13, 6) and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def _engine(async_scheduling, eos_at=None, max_model_len=256):
    config = make_config(async_scheduling=async_scheduling, max_model_len=max_model_len)
    executor = FakeExecutor(eos_at=eos_at)
    return EngineCore(config, executor), executor


def _only_final(finals, rid):
    assert len(finals[rid]) == 1, finals.get(rid)
    return finals[rid][0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_stop_conditions(async_scheduling):
    eos_at = {"eos": 3, "ignore": 2, "gated": 1, "gated_ok": 1}
    engine, executor = _engine(async_scheduling, eos_at)
    stop_id = expected_token("stopid", 9 + 2)
    reqs = {
        "eos": make_request("eos", 9, max_tokens=10, ignore_eos=False),
        "ignore": make_request("ignore", 9, max_tokens=6, ignore_eos=True),
        "stopid": make_request("stopid", 9, max_tokens=10, stop_token_ids=[stop_id]),
        "gated": make_request("gated", 9, max_tokens=5, ignore_eos=False, min_tokens=3),
        "gated_ok": make_request("gated_ok", 9, max_tokens=5, ignore_eos=False, min_tokens=2),
        "length": make_request("length", 9, max_tokens=4),
    }
    for r in reqs.values():
        engine.add_request(r)
    tokens, finals = collect(run_until_idle(engine))

    assert tokens["eos"] == expected_stream(reqs["eos"], 3)[:4]
    f = _only_final(finals, "eos")
    assert f.finish_reason == FinishReason.STOP and f.stop_reason is None

    assert tokens["ignore"] == expected_stream(reqs["ignore"], 2)
    assert tokens["ignore"][2] == EOS
    assert _only_final(finals, "ignore").finish_reason == FinishReason.LENGTH

    first = expected_stream(reqs["stopid"]).index(stop_id)
    assert tokens["stopid"] == expected_stream(reqs["stopid"])[:first + 1]
    f = _only_final(finals, "stopid")
    assert f.finish_reason == FinishReason.STOP and f.stop_reason == stop_id

    assert tokens["gated"] == expected_stream(reqs["gated"], 1)  # EOS at 1 < min_tokens=3
    assert _only_final(finals, "gated").finish_reason == FinishReason.LENGTH

    assert tokens["gated_ok"] == expected_stream(reqs["gated_ok"], 1)[:2]
    assert _only_final(finals, "gated_ok").finish_reason == FinishReason.STOP

    assert tokens["length"] == expected_stream(reqs["length"])
    assert _only_final(finals, "length").finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_stops_at_max_model_len(async_scheduling):
    engine, executor = _engine(async_scheduling, max_model_len=32)
    r = make_request("m", 20, max_tokens=None, max_model_len=32)
    engine.add_request(r)
    tokens, finals = collect(run_until_idle(engine))
    assert r.max_tokens == 12
    assert tokens["m"] == expected_stream(r)
    assert _only_final(finals, "m").finish_reason == FinishReason.LENGTH
    assert executor.runner.scheduled_tokens["m"] == 31  # positions 0..30; 31 is never input


def test_request_rejects_prompt_without_room():
    with pytest.raises(ValueError, match="3 tokens leaves no room to generate within max_model_len=3"):
        _req(max_model_len=3)
    with pytest.raises(ValueError, match="prompt is empty"):
        Request("e", [], SamplingParams(), frozenset(), 16, 0)
