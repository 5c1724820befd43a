"""The RayKVConnector's scheduler side through the real EngineCore and the fake runner.

Producer: a finished prompt's blocks outlive it until the consumer releases them (or the
timeout passes), its final output carries the params a consumer needs, an aborted one is
freed at once. Consumer: requests wait for their pulled KV in WAITING_FOR_REMOTE_KVS,
outside the batch; pulls that fail (in part or whole) or land late end with the right
tokens and no block held, sync and async.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from engine_drive import run_until_idle
from sched_fake_executor import FakeExecutor, expected_stream, make_config, make_request
from sched_fake_kv import FakeKVWorker
from test_kv_failed_loads import _run

from raylm.scheduler.config.kv_transfer_config import KVTransferConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.request import RequestStatus

BLOCK = 4


def pd_config(role: str, *, async_scheduling: bool = True, num_kv_blocks: int = 32,
              **extra):
    config = make_config(async_scheduling=async_scheduling, block_size=BLOCK,
                         num_kv_blocks=num_kv_blocks, max_num_seqs=4)
    return replace(config, parallel_config=replace(config.parallel_config,
                                                   distributed_executor_backend="ray"),
                   kv_transfer_config=KVTransferConfig("RayKVConnector", kv_role=role,
                                                       kv_connector_extra_config=extra))


def _producer(**extra) -> tuple[EngineCore, FakeKVWorker]:
    worker = FakeKVWorker()
    engine = EngineCore(pd_config("kv_producer", **extra),
                        FakeExecutor(num_blocks=32, block_size=BLOCK, kv_worker=worker))
    return engine, worker


def _remote_decode(rid: str, prompt_len: int = 13):
    return make_request(rid, prompt_len, max_tokens=1, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}})


def _usage(engine: EngineCore) -> float:
    return engine.scheduler.kv_cache_manager.usage


def test_producer_holds_blocks_until_released():
    engine, worker = _producer()
    engine.add_request(_remote_decode("p0"))
    finals = [o for o in run_until_idle(engine) if o.finished]
    params = finals[0].kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_request_id"] == "p0"
    assert params["remote_engine_id"] == engine.config.kv_transfer_config.engine_id
    assert worker.sends["p0"] and _usage(engine) > 0  # the workers may serve reads
    engine.scheduler.check_integrity(no_steps_in_flight=True)
    engine.release_kv(["p0"])
    run_until_idle(engine)  # the release frees; a step tells the workers to stop serving
    assert _usage(engine) == 0 and "p0" not in worker.sends
    engine.release_kv(["p0", "unknown"])  # a second release is a no-op
    run_until_idle(engine)


def test_aborted_producer_request_is_freed_at_once():
    engine, worker = _producer()
    engine.add_request(_remote_decode("p1", prompt_len=40))
    engine.step_fn()
    engine.abort_requests(["p1"])
    finals = [o for o in run_until_idle(engine) if o.finished]
    assert finals[0].kv_transfer_params is None
    assert _usage(engine) == 0


def test_unreleased_blocks_expire():
    engine, worker = _producer(abort_timeout_s=0.05)
    engine.add_request(_remote_decode("p2"))
    run_until_idle(engine)
    assert _usage(engine) > 0
    time.sleep(0.1)
    run_until_idle(engine)
    assert _usage(engine) == 0
    assert engine.get_metrics()["raylm:kv_transfer_num_kv_expired_reqs"] == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("faults", [None, {"fail_prob": 0.5, "seed": 1},
                                    {"fail_all": True}])
def test_consumer_pulls_recover_from_failures(async_scheduling, faults):
    prompts = {f"peer-{i}": make_request(f"peer-{i}", 5 + 6 * i).prompt_token_ids
               for i in range(5)}
    extra = {"fault_injection": faults} if faults else {}
    worker = FakeKVWorker(peer_prompts=prompts, delay_steps=3, seed=2)
    engine = EngineCore(pd_config("kv_consumer", async_scheduling=async_scheduling, **extra),
                        FakeExecutor(num_blocks=32, block_size=BLOCK, kv_worker=worker))
    reqs = [make_request(f"d{i}", prompts[f"peer-{i}"], max_tokens=6, extra_args={
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "peer",
                               "remote_request_id": f"peer-{i}", "remote_tp_size": 1}})
            for i in range(5)]
    for r in reqs:
        engine.add_request(r)
    engine.step_fn()
    assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in reqs)
    assert engine.get_metrics()["raylm:num_requests_waiting_for_remote_kvs"] == 5
    tokens = _run(engine)
    for r in reqs:
        assert tokens[r.request_id] == expected_stream(r)
    m = engine.get_metrics()
    assert m["raylm:external_prefix_cache_hits"] == sum(len(p) for p in prompts.values())
    assert m["raylm:kv_connector_num_recomputed_tokens"] == worker.expected_lost
    assert (m["raylm:kv_connector_num_failed_loads"] > 0) == (faults is not None)
    engine.scheduler.check_integrity(no_steps_in_flight=True)
    assert _usage(engine) == 0


def test_abort_while_waiting_for_remote_kv_frees_once_the_pull_lands():
    """The pull may still write into its blocks: they are freed when it reports."""
    prompt = make_request("peer-x", 21).prompt_token_ids
    worker = FakeKVWorker(peer_prompts={"peer-x": prompt}, delay_steps=4, seed=5)
    engine = EngineCore(pd_config("kv_consumer"),
                        FakeExecutor(num_blocks=32, block_size=BLOCK, kv_worker=worker))
    engine.add_request(make_request("dx", prompt, max_tokens=4, extra_args={
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "peer",
                               "remote_request_id": "peer-x", "remote_tp_size": 1}}))
    engine.step_fn()
    engine.abort_requests(["dx"])
    engine.step_fn()
    assert "dx" in engine.scheduler.kv_transfer.delayed_free and _usage(engine) > 0
    run_until_idle(engine)
    assert not engine.scheduler.kv_transfer.delayed_free and _usage(engine) == 0


def test_pd_transport_is_the_consumers_choice_among_known_ones():
    from raylm.scheduler.config.kv_transfer_config import DEFAULT_PD_TRANSPORT

    assert pd_config("kv_consumer").kv_transfer_config.pd_transport == DEFAULT_PD_TRANSPORT
    assert pd_config("kv_consumer", transport="rdt").kv_transfer_config.pd_transport == "rdt"
    with pytest.raises(ValueError, match="transport must be one of"):
        pd_config("kv_consumer", transport="nccl")
    with pytest.raises(ValueError, match="unknown key"):
        KVTransferConfig("OffloadingConnector", kv_connector_extra_config={
            "num_cpu_blocks": 4, "transport": "rdt"})
