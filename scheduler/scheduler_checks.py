"""The invariants the tests and the idle EngineCore assert (``Scheduler.check_integrity``).

A function of the parts it checks (the KV manager, the request dict and the three queues),
so it needs nothing of the Scheduler itself.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from raylm.scheduler.kv.kv_cache_manager import KVCacheManager
from raylm.scheduler.kv_transfer.kv_transfer_scheduling import KVTransferScheduling
from raylm.scheduler.request import Request, RequestStatus


def check_scheduler_integrity(kv: KVCacheManager, requests: Mapping[str, Request],
                              waiting: Collection[Request], running: Collection[Request],
                              waiting_for_fsm: Collection[Request],
                              no_steps_in_flight: bool = False,
                              kv_transfer: KVTransferScheduling | None = None) -> None:
    """Block pool and ref counts; every request in exactly one queue with a sane ledger.

    With nothing in flight, also: no placeholders, in-flight or stale tokens, no deferred
    frees, and an empty pool when no request is left (and no transfer holds blocks).
    """
    kv.check_integrity()
    remote = kv_transfer.waiting_for_remote_kvs if kv_transfer is not None else {}
    loaded = kv_transfer.loaded if kv_transfer is not None else set()
    num_queued = len(waiting) + len(running) + len(waiting_for_fsm) + len(remote)
    assert len(requests) == num_queued, (
        f"{len(requests)} requests but {len(waiting)} waiting + {len(running)} running + "
        f"{len(waiting_for_fsm)} waiting for FSM + {len(remote)} waiting for remote KV")
    for r in running:
        assert r.status == RequestStatus.RUNNING and r.request_id in kv.req_to_blocks, r
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
        # Only a request whose KV a connector loaded waits with blocks.
        assert (r.request_id in kv.req_to_blocks) == (r.request_id in loaded), r
    for r in remote.values():
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and (
            r.request_id in kv.req_to_blocks), r
    for r in requests.values():
        assert min(r.num_computed_tokens, r.num_output_placeholders, r.num_in_flight_tokens,
                   r.num_stale_output_tokens) >= 0, r
        if no_steps_in_flight:
            assert r.num_in_flight_tokens == 0 and r.num_output_placeholders == 0 and (
                r.num_stale_output_tokens == 0), r
    if no_steps_in_flight:
        assert not kv.has_deferred_frees(), (
            f"{kv.num_deferred_blocks} blocks still deferred with no step in flight")
        if not requests and not (kv_transfer is not None and kv_transfer.delayed_free):
            free = kv.block_pool.get_num_free_blocks()
            assert free == kv.num_blocks, f"idle with {kv.num_blocks - free} blocks in use"
