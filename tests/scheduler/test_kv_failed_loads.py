"""Failed KV loads (docs/architecture.md §3, "failed KV loads roll back"): the seed's
boundary case, step by step, then a property test of the ledger under a fault injector.

The fake runner (sched_fake_executor.py) poisons whatever a request computes on KV that
failed to load, so a token kept from such a step shows up as a wrong token; its checks of
every prefix hit catch a garbage block that stayed in the prefix cache.
"""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_fake_executor import (
    FakeExecutor,
    expected_stream,
    make_config,
    make_request,
    prompt_tokens,
)
from sched_fake_kv import FakeKVWorker
from test_engine_property import _record_fences, drive

from raylm.scheduler.config.kv_transfer_config import KVTransferConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core_outputs import FinishReason
from raylm.scheduler.request import RequestStatus

BLOCK = 4


def offload_config(*, num_cpu_blocks: int = 32, load_async: bool = False,
                   faults: dict | None = None, **kwargs):
    extra: dict = {"num_cpu_blocks": num_cpu_blocks, "load_async": load_async}
    if faults is not None:
        extra["fault_injection"] = faults
    config = make_config(block_size=BLOCK, **kwargs)
    return replace(config, kv_transfer_config=KVTransferConfig(
        "OffloadingConnector", kv_connector_extra_config=extra))


def _run(engine: EngineCore, max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return tokens
        out, _ = engine.step_fn()
        for o in out.outputs if out is not None else ():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("engine did not drain")


def _evict_into_host(engine: EngineCore, prompt: list[int]) -> None:
    """Run ``prompt`` once, then a filler that needs the whole pool: the prompt's cached
    blocks are evicted from the device and saved in the host tier."""
    engine.add_request(make_request("first", prompt, max_tokens=2))
    _run(engine)
    engine.add_request(make_request("filler", 28, max_tokens=2))
    _run(engine)


def test_failed_load_with_placeholders_in_flight():
    """The seed's case: a request loads its prefix from the host tier, its step samples
    (an output placeholder is booked) and the next step is already scheduled on top of it
    when the load is reported failed. The request returns to the end of its last good
    block, the step in flight becomes stale, and it finishes with the right tokens."""
    config = offload_config(async_scheduling=True, num_kv_blocks=8,
                            faults={"fail_prob": 1.0, "seed": 0})
    worker = FakeKVWorker(num_cpu_blocks=32)
    engine = EngineCore(config, FakeExecutor(num_blocks=8, block_size=BLOCK, kv_worker=worker))
    prompt = prompt_tokens("p", 20)
    _evict_into_host(engine, prompt)
    sched = engine.scheduler
    again = make_request("again", prompt, max_tokens=6)
    engine.add_request(again)
    engine.step_fn()  # step t: loads 4 blocks (16 tokens), computes 4, books a placeholder
    assert sched.kv_transfer.connector.stats.external_hits == 16
    assert again.num_computed_tokens == 20 and again.num_output_placeholders == 1
    executor = engine.executor
    # Step t + 1 is scheduled on top of the placeholder (a decode, in flight); the queue
    # is full, so step t's result comes back in the same call: every loaded block failed.
    engine.step_fn()
    decode = executor.history[-1]
    assert decode.num_scheduled_tokens == {"again": 1} and "again" not in {
        r.req_id for r in decode.scheduled_new_reqs}
    assert len(engine.batch_queue) == 1  # step t + 1 still in flight
    assert again.num_computed_tokens == 0, "no good block before the first failed one"
    assert again.num_output_placeholders == 0 and again.output_token_ids == []
    assert again.num_stale_output_tokens == again.num_in_flight_tokens == 1
    assert "again" in sched.kv_transfer.needs_resend
    metrics = engine.get_metrics()
    assert metrics["raylm:kv_connector_num_failed_loads"] == 4
    assert metrics["raylm:kv_connector_num_recomputed_tokens"] == 20  # 16 loaded + 4 computed
    tokens = _run(engine)
    assert tokens["again"] == expected_stream(again)
    sched.check_integrity(no_steps_in_flight=True)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_good_prefix_survives_a_partly_failed_load():
    """Only the blocks from the first failed one on are recomputed (sync scheduling)."""
    config = offload_config(async_scheduling=False, num_kv_blocks=8)
    worker = FakeKVWorker(num_cpu_blocks=32)
    engine = EngineCore(config, FakeExecutor(num_blocks=8, block_size=BLOCK, kv_worker=worker))
    prompt = prompt_tokens("p", 20)
    _evict_into_host(engine, prompt)
    injector = _spoil_the_third_loaded_block(engine)
    again = make_request("again", prompt, max_tokens=3)
    engine.add_request(again)
    engine.step_fn()
    assert injector.spoiled == 1
    assert again.num_computed_tokens == 8 and again.output_token_ids == []
    assert _run(engine)["again"] == expected_stream(again)
    assert engine.get_metrics()["raylm:kv_connector_num_recomputed_tokens"] == 20 - 8


def _spoil_the_third_loaded_block(engine: EngineCore):
    from raylm.scheduler.kv_transfer.fault_injection import FaultInjectionMetadata

    connector = engine.scheduler.kv_transfer.connector
    build = connector.build_connector_meta

    class Spoiler:
        spoiled = 0

        @staticmethod
        def build(so, requests):
            meta = build(so, requests)
            loads = meta.load_block_ids() if meta is not None else []
            if len(loads) < 3:
                return meta
            Spoiler.spoiled += 1
            return FaultInjectionMetadata(inner=meta, spoiled_block_ids={loads[2]})

    connector.build_connector_meta = Spoiler.build
    return Spoiler


def test_async_load_waits_outside_the_batch_and_may_arrive_late():
    """An asynchronous load parks the request in WAITING_FOR_REMOTE_KVS: it holds its
    blocks but no place in the batch, other requests run meanwhile."""
    config = offload_config(async_scheduling=True, num_kv_blocks=10, load_async=True,
                            max_num_seqs=1)
    worker = FakeKVWorker(num_cpu_blocks=32, delay_steps=0)
    engine = EngineCore(config, FakeExecutor(num_blocks=10, block_size=BLOCK, kv_worker=worker))
    prompt = prompt_tokens("p", 20)
    _evict_into_host(engine, prompt)
    worker.delay_steps, worker.rng = 5, random.Random(3)  # arrives late
    again = make_request("again", prompt, max_tokens=3)
    other = make_request("other", 6, max_tokens=8)
    engine.add_request(again)
    engine.add_request(other)
    engine.step_fn()
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert other.status == RequestStatus.RUNNING  # max_num_seqs=1: the waiter holds no seat
    tokens = _run(engine)
    assert tokens["again"] == expected_stream(again)
    assert tokens["other"] == expected_stream(other)


# ---- the property test ---------------------------------------------------------------------

request_st = st.tuples(
    st.integers(0, 24),  # arrival step
    st.sampled_from([0, 0, 1, 1, 2, 3, 3]),  # the shared prompt it repeats (3: a fresh one)
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.none(), st.none(), st.integers(0, 12)),  # abort after
)


@st.composite
def scenarios(draw):
    return {
        "async": draw(st.booleans()),
        "num_blocks": draw(st.integers(7, 14)),
        "num_cpu_blocks": draw(st.integers(1, 40)),
        "budget": draw(st.integers(4, 32)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "load_async": draw(st.booleans()),
        "fail_all": draw(st.sampled_from([False, False, True])),
        "fail_prob": draw(st.sampled_from([0.0, 0.3, 0.7])),
        "delay": draw(st.sampled_from([0, 0, 3])),
        "k": draw(st.sampled_from([0, 0, 2])),
        "requests": draw(st.lists(request_st, min_size=4, max_size=14)),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_failed_loads_keep_the_ledger_balanced(sc):
    faults = {"fail_prob": sc["fail_prob"], "fail_all": sc["fail_all"], "seed": sc["seed"]}
    config = offload_config(
        async_scheduling=sc["async"], num_kv_blocks=sc["num_blocks"],
        num_cpu_blocks=sc["num_cpu_blocks"], load_async=sc["load_async"], faults=faults,
        max_num_batched_tokens=sc["budget"], max_num_seqs=sc["max_num_seqs"],
        num_spec_tokens=sc["k"])
    worker = FakeKVWorker(num_cpu_blocks=sc["num_cpu_blocks"], delay_steps=sc["delay"],
                          seed=sc["seed"])
    spec_rng = random.Random(sc["seed"] + 1) if sc["k"] else None
    executor = FakeExecutor(num_blocks=sc["num_blocks"], block_size=BLOCK, kv_worker=worker,
                            spec_rng=spec_rng)
    engine = EngineCore(config, executor)
    fenced = _record_fences(engine, executor)
    room = sc["num_blocks"] * BLOCK
    shared = [prompt_tokens(f"s{i}", min(4 + 7 * i, room - 2)) for i in range(3)]
    arrivals, aborts, reqs = {}, {}, {}
    for i, (arrive, which, max_tokens, abort_after) in enumerate(sc["requests"]):
        rid = f"r{i}"
        prompt = shared[which] if which < 3 else prompt_tokens(rid, 9)
        max_tokens = max(1, min(max_tokens, room - len(prompt)))
        req = make_request(rid, prompt, max_tokens=max_tokens)
        reqs[rid] = req
        arrivals.setdefault(arrive, []).append(req)
        if abort_after is not None:
            aborts.setdefault(arrive + abort_after, []).append(rid)
    delivered, finals = drive(engine, executor, fenced, arrivals, aborts,
                              random.Random(sc["seed"]))
    for rid, r in reqs.items():
        assert len(finals[rid]) == 1, (rid, finals[rid])
        want, got = expected_stream(r), delivered[rid]
        assert got == want[:len(got)], (rid, got, want)  # no garbage token ever
        if finals[rid][0].finish_reason != FinishReason.ABORT:
            assert got == want, (rid, got, want)
    metrics = engine.get_metrics()
    failed = metrics["raylm:kv_connector_num_failed_loads"]
    recomputed = metrics["raylm:kv_connector_num_recomputed_tokens"]
    assert failed <= worker.num_spoiled
    assert recomputed <= worker.expected_lost and (failed > 0 or recomputed == 0)
    if not metrics["raylm:num_preemptions"] and not aborts:
        # Nothing dropped a failed step's result first: every lost token is counted.
        assert failed == worker.num_spoiled and recomputed == worker.expected_lost
    event(f"loads failed: {failed > 0}")
    event(f"loaded from host: {worker.num_loaded_blocks > 0}")
    event(f"preempted: {metrics['raylm:num_preemptions'] > 0}")
    engine.scheduler.check_integrity(no_steps_in_flight=True)
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks  # no block leaks
