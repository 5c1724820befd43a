"""LoRA on the scheduler's side: a step never holds requests of more than max_loras
distinct adapters (those of other adapters wait, in order, and nothing is lost; base-model
requests never wait for a slot), prefix-cache blocks are keyed by adapter, the
lora_requests_info metric, and a request naming an adapter on an engine without LoRA."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from engine_drive import run_until_idle
from sched_fake_executor import (
    FakeExecutor,
    collect,
    expected_stream,
    make_config,
    make_request,
)

from raylm.scheduler.config.lora_config import LoRAConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.kv.kv_cache_utils import update_block_hashes
from raylm.scheduler.lora import MAX_LORA_SKIPS, LoRARequest
from raylm.scheduler.request import InvalidRequestError
from raylm.scheduler.scheduler import Scheduler

ADAPTERS = [LoRARequest(f"adapter{i}", i + 1, f"/adapters/{i}") for i in range(4)]


def _lora_config(async_scheduling: bool, max_loras: int, **kwargs):
    config = make_config(async_scheduling=async_scheduling, **kwargs)
    return replace(config, lora_config=LoRAConfig(max_loras=max_loras))


def _with_lora(request, lora):
    request.lora_request = lora
    return request


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_holds_at_most_max_loras_adapters_and_nothing_is_lost(async_scheduling):
    rng = random.Random(3)
    engine_config = _lora_config(async_scheduling, 2, max_num_batched_tokens=32,
                                 num_kv_blocks=40)
    executor = FakeExecutor(num_blocks=40)
    engine = EngineCore(engine_config, executor)
    lora_of = {}
    requests = []
    for i in range(16):
        lora = None if i % 5 == 4 else ADAPTERS[rng.randrange(4)]
        r = _with_lora(make_request(f"r{i}", rng.randint(3, 20), max_tokens=rng.randint(4, 12)),
                       lora)
        lora_of[r.request_id] = lora
        requests.append(r)
        engine.add_request(r)
    tokens, _ = collect(run_until_idle(engine))
    for r in requests:
        assert tokens[r.request_id] == expected_stream(r)
    per_step = [{lora_of[rid].lora_int_id for rid in so.num_scheduled_tokens
                 if lora_of[rid] is not None} for so in executor.history]
    assert max(len(s) for s in per_step) == 2
    assert len(set().union(*per_step)) == 4  # all four ran, two at a time
    engine.scheduler.check_integrity(no_steps_in_flight=True)


def test_waiting_requests_keep_their_order_and_base_requests_pass():
    sched = Scheduler(_lora_config(False, 1), num_kv_blocks=64)
    a, b = ADAPTERS[:2]
    for rid, lora in (("a1", a), ("b1", b), ("base", None), ("a2", a), ("b2", b)):
        sched.add_request(_with_lora(make_request(rid, 6), lora))
    so = sched.schedule()
    assert sorted(so.num_scheduled_tokens) == ["a1", "a2", "base"]
    assert [r.request_id for r in sched.waiting] == ["b1", "b2"]
    new = {n.req_id: n.lora_request for n in so.scheduled_new_reqs}
    assert new == {"a1": a, "base": None, "a2": a}  # the workers learn the adapter
    (info,) = sched.lora_metrics()
    assert info == ('raylm:lora_requests_info{running_lora_adapters="adapter0",'
                    'waiting_lora_adapters="adapter1",max_lora="1"}')


def test_a_request_passed_over_too_long_holds_other_adapters_back():
    """max_loras=1, adapter a always busy: a new ``a`` request arrives every step. b1 is
    passed over until its skips exceed MAX_LORA_SKIPS; then later ``a`` requests wait
    behind it (base requests still pass), a drains, and b1 runs."""
    engine = EngineCore(_lora_config(False, 1, max_num_batched_tokens=64, num_kv_blocks=200),
                        FakeExecutor(num_blocks=200))
    a, b = ADAPTERS[:2]
    engine.add_request(_with_lora(make_request("a0", 4, max_tokens=6), a))
    b1 = _with_lora(make_request("b1", 4, max_tokens=3), b)
    engine.add_request(b1)
    first_b_step = None
    for step in range(60):
        engine.add_request(_with_lora(make_request(f"a{step + 1}", 4, max_tokens=6), a))
        engine.add_request(make_request(f"base{step}", 4, max_tokens=2))
        engine.step()
        running = {r.request_id for r in engine.scheduler.running}
        if "b1" in running and first_b_step is None:
            first_b_step = step
            assert not any(rid.startswith("a") for rid in running), running  # a drained
    assert first_b_step is not None and MAX_LORA_SKIPS < first_b_step < MAX_LORA_SKIPS + 12
    assert b1.num_lora_skips > MAX_LORA_SKIPS
    collect(run_until_idle(engine))
    engine.scheduler.check_integrity(no_steps_in_flight=True)


def test_prefix_blocks_are_keyed_by_adapter():
    def hashes(lora):
        r = _with_lora(make_request("x", list(range(10, 26))), lora)
        update_block_hashes(r, 4)
        return r.block_hashes

    base, a, b = hashes(None), hashes(ADAPTERS[0]), hashes(ADAPTERS[1])
    assert len(base) == 4 and hashes(ADAPTERS[0]) == a  # deterministic per adapter
    assert not set(base) & set(a) and not set(a) & set(b) and not set(base) & set(b)


def test_a_request_naming_an_adapter_needs_lora_on():
    sched = Scheduler(make_config(async_scheduling=False), num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="enable_lora=False"):
        sched.add_request(_with_lora(make_request("r", 5), ADAPTERS[0]))
    assert sched.lora_metrics() == {}


def test_lora_config_checks_itself():
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3
    with pytest.raises(ValueError, match="max_cpu_loras must be an int of at least "
                                         "max_loras=4"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be an int of at least 1"):
        LoRAConfig(max_lora_rank=0)
