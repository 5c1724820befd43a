"""KVTransferScheduling: the Scheduler's collaborator for KV that comes from outside.

It owns the connector's scheduler side and the requests it concerns: those waiting for
their remote KV (WAITING_FOR_REMOTE_KVS, outside the running batch), those whose load has
landed and wait to be scheduled while holding their blocks, finished ones whose blocks
are held for a transfer (the delayed free), and running ones that a failed load rolled
back, which are sent to the workers again in full. Failed loads are settled here: each
request holding a failed block returns to the end of its last good block
(``roll_back_failed_load``, docs/architecture.md §3 rule 9).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from raylm.scheduler.async_ledger import roll_back_failed_load
from raylm.scheduler.core_outputs import KVConnectorOutput, SchedulerOutput
from raylm.scheduler.kv.kv_cache_manager import KVCacheManager
from raylm.scheduler.kv_transfer.base import KVConnectorScheduler
from raylm.scheduler.request import Request, RequestStatus


@dataclass
class KVTransferCounters:
    """Cumulative; the workers' transfer counters are summed in ``worker_stats``."""

    num_failed_loads: int = 0  # blocks reported failed
    num_failed_load_requests: int = 0  # requests rolled back
    num_recomputed_tokens: int = 0  # settled tokens a failed load made recompute


class KVTransferScheduling:
    def __init__(self, connector: KVConnectorScheduler | None, *,
                 kv_cache_manager: KVCacheManager, block_size: int) -> None:
        """The Scheduler's requests and waiting queue are its own: each call that needs
        them is handed them, and requests to queue are returned to the Scheduler."""
        self.connector = connector
        self.kv = kv_cache_manager
        self.block_size = block_size
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        self.received: set[str] = set()  # landed, to be admitted (hold their blocks)
        self.loaded: set[str] = set()  # in the waiting queue, holding their blocks
        self.needs_resend: set[str] = set()  # running, rolled back: rebuild on the workers
        self.delayed_free: dict[str, Request] = {}
        self.counters = KVTransferCounters()
        self.worker_stats: dict[str, float] = {}
        if connector is not None:
            kv_cache_manager.block_pool.on_evict = connector.on_block_evicted

    @property
    def enabled(self) -> bool:
        return self.connector is not None

    # ---- admission -------------------------------------------------------------------
    def holds_blocks(self, request: Request) -> bool:
        """A waiting request whose loaded KV is already in its blocks (no prefix lookup)."""
        return request.request_id in self.loaded

    def match(self, request: Request, num_hit: int) -> tuple[int, bool]:
        """External tokens past the device hit, and whether they load asynchronously."""
        if self.connector is None:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        stats = self.connector.stats
        stats.external_queries += max(request.num_tokens - num_hit, 0)
        stats.external_hits += num_external
        return num_external, load_async

    def after_alloc(self, request: Request, num_hit: int, num_external: int,
                    load_async: bool) -> None:
        """Record the load; an asynchronous one parks the request until it lands."""
        self.loaded.discard(request.request_id)
        if self.connector is None or num_external == 0:
            return
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), num_hit, num_external)
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote_kvs[request.request_id] = request

    def admit_received(self) -> list[Request]:
        """Requests whose KV has landed, for the front of the waiting queue (each in turn:
        the last one first), computed up to what loaded well (never their last known
        token: it is computed to sample)."""
        admitted = []
        for rid in sorted(self.received):
            request = self.waiting_for_remote_kvs.pop(rid)
            request.num_computed_tokens = min(request.num_computed_tokens,
                                              request.num_tokens - 1)
            request.status = RequestStatus.WAITING
            self.loaded.add(rid)
            admitted.append(request)
        self.received.clear()
        return admitted

    def reclaim_loaded(self, waiting: Iterable[Request], exclude: Request | None = None) -> bool:
        """Free the blocks of the newest loaded request still waiting (its good full
        blocks stay in the prefix cache): a waiting request cannot preempt, so blocks held
        by one must be given up when they are what another needs to make progress."""
        for request in reversed(list(waiting)):
            rid = request.request_id
            if request is exclude or rid not in self.loaded:
                continue
            self.kv.cache_blocks(request, request.num_computed_tokens)
            self.kv.free(request)
            self.loaded.discard(rid)
            request.num_computed_tokens = 0
            return True
        return False

    # ---- per step --------------------------------------------------------------------
    def build_meta(self, scheduler_output: SchedulerOutput,
                   requests: Mapping[str, Request]) -> None:
        if self.connector is None:
            return
        self.free_expired()
        scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
            scheduler_output, requests)

    def free_expired(self) -> None:
        """Free the blocks of finished requests whose transfer never came (timeout)."""
        if self.delayed_free and self.connector is not None:
            for rid in self.connector.take_expired(time.monotonic()):
                self._free_delayed(rid)

    def has_pending_work(self) -> bool:
        """A step must go out even with nothing scheduled (a load to hear from)."""
        return (self.connector is not None
                and (bool(self.waiting_for_remote_kvs) or self.connector.has_pending_work()))

    # ---- results ---------------------------------------------------------------------
    def on_step_output(self, output: KVConnectorOutput | None,
                       requests: Mapping[str, Request]) -> dict[str, int]:
        """Apply a step's connector report. Returns the requests a failed load touches,
        each with the tokens it keeps (the start of its first failed block); the caller
        rolls them back, running ones after settling this step's in-flight count."""
        if output is None or self.connector is None:
            return {}
        for key, value in output.stats.items():
            self.worker_stats[key] = self.worker_stats.get(key, 0.0) + value
        self.connector.update_connector_output(output)
        failed: dict[str, int] = {}
        if output.invalid_block_ids:
            self.counters.num_failed_loads += len(output.invalid_block_ids)
            failed = self._requests_with_failed_blocks(output.invalid_block_ids, requests)
            self.kv.uncache_block_ids(output.invalid_block_ids)
        for rid in output.finished_sending:
            self._free_delayed(rid)
        for rid in output.finished_recving:
            if rid in self.delayed_free:
                self._free_delayed(rid)
            elif rid in self.waiting_for_remote_kvs:
                self.received.add(rid)
        return failed

    def _requests_with_failed_blocks(self, invalid: set[int],
                                     requests: Mapping[str, Request]) -> dict[str, int]:
        failed = {}
        for rid, request in requests.items():
            block_ids = self.kv.get_block_ids(rid)
            first = next((i for i, b in enumerate(block_ids) if b in invalid), None)
            if first is not None:
                failed[rid] = min(first * self.block_size, request.num_computed_tokens)
        return failed

    def roll_back(self, request: Request, num_good_tokens: int) -> None:
        """The failed-load rule on one request: back to its last good block, the blocks
        from the first failed one out of the prefix cache, and, when the workers hold its
        state, a full resend to rebuild it."""
        rid = request.request_id
        settled = request.num_computed_tokens - request.num_in_flight_tokens
        if num_good_tokens >= settled:
            return  # the failed blocks lie past everything it has computed
        num_good = num_good_tokens
        self.counters.num_recomputed_tokens += roll_back_failed_load(request, num_good)
        self.counters.num_failed_load_requests += 1
        self.kv.invalidate_from(rid, num_good // self.block_size)
        if request.status == RequestStatus.RUNNING:
            self.needs_resend.add(rid)

    # ---- finish ----------------------------------------------------------------------
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Whether to hold the finished request's blocks, and the params its output
        carries. Drops it from every queue of this collaborator."""
        rid = request.request_id
        self.waiting_for_remote_kvs.pop(rid, None)
        self.received.discard(rid)
        self.loaded.discard(rid)
        self.needs_resend.discard(rid)
        if self.connector is None:
            return False, None
        delay, params = self.connector.request_finished(request, self.kv.get_block_ids(rid))
        if delay:
            self.delayed_free[rid] = request
        return delay, params

    def forget(self, request: Request) -> None:
        """A preempted request restarts from scratch: nothing of it is pending here."""
        self.needs_resend.discard(request.request_id)
        self.loaded.discard(request.request_id)

    def release(self, request_ids: list[str]) -> None:
        """A peer has pulled these finished requests' KV: free their blocks."""
        if self.connector is None:
            return
        for rid in self.connector.release(request_ids):
            self._free_delayed(rid)

    def _free_delayed(self, rid: str) -> None:
        request = self.delayed_free.pop(rid, None)
        if request is not None:
            self.kv.free(request)

    # ---- queries ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """vLLM's names where it has them (external prefix cache, kv_offload_*; the P/D
        transport's are NIXL's with a neutral prefix), raylm's for failed loads."""
        if self.connector is None:
            return {}
        stats = self.connector.stats
        c = self.counters
        out: dict[str, float] = {
            "raylm:external_prefix_cache_queries": stats.external_queries,
            "raylm:external_prefix_cache_hits": stats.external_hits,
            "raylm:kv_connector_num_failed_loads": c.num_failed_loads,
            "raylm:kv_connector_num_failed_load_requests": c.num_failed_load_requests,
            "raylm:kv_connector_num_recomputed_tokens": c.num_recomputed_tokens,
            "raylm:num_requests_waiting_for_remote_kvs": len(self.waiting_for_remote_kvs),
        }
        out.update(stats.extra)  # the connector's own, full names
        out.update(self.worker_stats)
        return out
