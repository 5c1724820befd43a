"""Scheduler.check_integrity: the invariants tests and the idle EngineCore assert."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raylm.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from raylm.scheduler.scheduler import Scheduler


def check_scheduler_integrity(scheduler: Scheduler, no_steps_in_flight: bool = False) -> None:
    """Block pool and ref counts; every request in exactly one queue with a sane ledger.

    With nothing in flight, also: no placeholders, in-flight or stale tokens, no deferred
    frees, and an empty pool when no request is left.
    """
    kv = scheduler.kv_cache_manager
    kv.check_integrity()
    num_queued = len(scheduler.waiting) + len(scheduler.running) + len(scheduler.waiting_for_fsm)
    assert len(scheduler.requests) == num_queued, (
        f"{len(scheduler.requests)} requests but {len(scheduler.waiting)} waiting + "
        f"{len(scheduler.running)} running + {len(scheduler.waiting_for_fsm)} waiting for FSM")
    for r in scheduler.running:
        assert r.status == RequestStatus.RUNNING and r.request_id in kv.req_to_blocks, r
    for r in scheduler.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
        assert r.request_id not in kv.req_to_blocks, r
    for r in scheduler.requests.values():
        assert min(r.num_computed_tokens, r.num_output_placeholders, r.num_in_flight_tokens,
                   r.num_stale_output_tokens) >= 0, r
        if no_steps_in_flight:
            assert r.num_in_flight_tokens == 0 and r.num_output_placeholders == 0 and (
                r.num_stale_output_tokens == 0), r
    if no_steps_in_flight:
        assert not kv.has_deferred_frees(), (
            f"{kv.num_deferred_blocks} blocks still deferred with no step in flight")
        if not scheduler.requests:
            free = kv.block_pool.get_num_free_blocks()
            assert free == kv.num_blocks, f"idle with {kv.num_blocks - free} blocks in use"
