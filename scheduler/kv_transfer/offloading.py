"""OffloadingConnector, scheduler side: a host-memory tier under the device pool.

A cached device block that the pool evicts for reuse is copied to a host slot first (its
KV is settled and no step in flight touches it); a request admitted later whose prefix
misses on the device but hits on the host gets those blocks loaded back instead of
computing them. The host tier is an LRU over block hashes, ``num_cpu_blocks`` slots.
Ordering on the workers: a step's saves run before its loads (an evicted block may be the
very block a load writes into), and slots a step loads from are pinned until its orders
are built, or an asynchronous load has reported (a later eviction must not reuse them);
a match pins its slots at once, as the allocation that follows may evict device blocks
into the host tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raylm.scheduler.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler

# Counters with vLLM's offloading names (and raylm's for the stores themselves).
LOOKUPS = "raylm:kv_offload_cpu_block_lookup"
HITS = "raylm:kv_offload_cpu_block_hit"
STORES = "raylm:kv_offload_stores"
SKIPPED = "raylm:kv_offload_stores_skipped"
USAGE = "raylm:kv_offload_cpu_cache_usage_perc"

if TYPE_CHECKING:
    from raylm.scheduler.config.kv_transfer_config import KVTransferConfig
    from raylm.scheduler.core_outputs import KVConnectorOutput, SchedulerOutput
    from raylm.scheduler.request import Request


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """Device -> host copies (``saves``: block id, host slot) first, then host -> device
    (``loads``: host slot, block id). ``async_loads``: requests whose loads the workers
    report in ``finished_recving`` (the rest complete within the step)."""

    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    async_loads: dict[str, list[int]] = field(default_factory=dict)

    def load_block_ids(self) -> list[int]:
        return [block_id for _, block_id in self.loads]

    def is_empty(self) -> bool:
        return not (self.saves or self.loads)


class OffloadingConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, **kwargs: Any) -> None:
        super().__init__(config, block_size, **kwargs)
        self.num_cpu_blocks = config.num_cpu_blocks
        self.load_async = bool(config.extra("load_async", False))
        self.host: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self.free_slots = list(range(self.num_cpu_blocks - 1, -1, -1))
        self.pinned: dict[int, int] = {}  # slot -> pins (loads not done yet)
        self._sync_pins: list[int] = []  # slots this step loads from synchronously
        self._matched: list[int] = []  # slots of the latest match, until its allocation
        self._async_pins: dict[str, list[int]] = {}  # request -> slots of its async load
        self._meta = OffloadingMetadata()
        self.stats.extra.update({LOOKUPS: 0, HITS: 0, STORES: 0, SKIPPED: 0,
                                 USAGE: 0.0})

    # ---- admission -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        sp = request.sampling_params
        if sp.prompt_logprobs is not None or sp.pools_every_prompt_row \
                or not request.block_hashes:
            return 0, False  # a loaded position has no prompt logprob, no pooled row
        bs = self.block_size
        start = num_computed_tokens // bs
        end = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        self._unpin(self._matched)  # an earlier match whose allocation failed
        self._matched = []
        for h in request.block_hashes[start:end]:
            slot = self.host.get(h)
            if slot is None:
                break
            self.host.move_to_end(h)
            self.pinned[slot] = self.pinned.get(slot, 0) + 1
            self._matched.append(slot)
        n = len(self._matched)
        self.stats.extra[LOOKUPS] += max(end - start, 0)
        self.stats.extra[HITS] += n
        return n * bs, self.load_async and n > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        first = num_local_tokens // self.block_size
        indices = range(first, first + num_external_tokens // self.block_size)
        slots, self._matched = self._matched, []  # pinned by the match
        assert len(slots) == len(indices), (request.request_id, slots, list(indices))
        for slot, i in zip(slots, indices, strict=True):
            self._meta.loads.append((slot, block_ids[i]))
        if self.load_async:
            self._async_pins[request.request_id] = slots
            self._meta.async_loads[request.request_id] = [block_ids[i] for i in indices]
        else:
            self._sync_pins.extend(slots)

    # ---- eviction --------------------------------------------------------------------
    def on_block_evicted(self, block_hash: int, block_id: int) -> None:
        if block_hash in self.host:
            self.host.move_to_end(block_hash)  # already kept: nothing to copy
            return
        slot = self._take_slot()
        if slot is None:
            self.stats.extra[SKIPPED] += 1
            return
        self.host[block_hash] = slot
        self._meta.saves.append((block_id, slot))
        self.stats.extra[STORES] += 1
        self.stats.extra[USAGE] = len(self.host) / self.num_cpu_blocks

    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for h, slot in self.host.items():  # least recently used first
            if slot not in self.pinned:
                del self.host[h]
                return slot
        return None

    def _unpin(self, slots: list[int]) -> None:
        for slot in slots:
            left = self.pinned[slot] - 1
            if left:
                self.pinned[slot] = left
            else:
                del self.pinned[slot]

    # ---- per step --------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: Mapping[str, Request]) -> OffloadingMetadata | None:
        meta, self._meta = self._meta, OffloadingMetadata()
        self._unpin(self._sync_pins + self._matched)  # synchronous loads are done in-step
        self._sync_pins, self._matched = [], []
        return None if meta.is_empty() else meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            self._unpin(self._async_pins.pop(rid, []))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # An asynchronous load still landing in its blocks: keep them until it reports.
        return request.request_id in self._async_pins, None

    def has_pending_work(self) -> bool:
        return bool(self._async_pins)
