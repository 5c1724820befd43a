"""A fault injector around any connector's scheduler side (tests and drills).

The scheduler side decides which loads fail, from a seeded RNG, so that every rank spoils
the same blocks: each step's orders name the blocks whose load the workers must ruin and
report in ``invalid_block_ids`` (``fail_prob`` of them, or all with ``fail_all``). A late
arrival (``delay_steps``) is played by the workers, which hold back the completion of an
asynchronous load. Everything else is the wrapped connector's.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raylm.scheduler.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler

if TYPE_CHECKING:
    from raylm.scheduler.config.kv_transfer_config import FaultInjection
    from raylm.scheduler.core_outputs import KVConnectorOutput, SchedulerOutput
    from raylm.scheduler.request import Request


@dataclass
class FaultInjectionMetadata(KVConnectorMetadata):
    inner: KVConnectorMetadata | None = None
    spoiled_block_ids: set[int] = field(default_factory=set)

    def load_block_ids(self) -> list[int]:
        return self.inner.load_block_ids() if self.inner is not None else []

    def is_empty(self) -> bool:
        return self.inner is None or self.inner.is_empty()


class FaultInjectingScheduler(KVConnectorScheduler):
    def __init__(self, inner: KVConnectorScheduler, faults: FaultInjection) -> None:
        super().__init__(inner.config, inner.block_size, inner.get_block_ids)
        self.inner = inner
        self.stats = inner.stats
        self.faults = faults
        self.rng = random.Random(faults.seed)
        self.num_spoiled = 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        self.inner.update_state_after_alloc(request, block_ids, num_local_tokens,
                                            num_external_tokens)

    def on_block_evicted(self, block_hash: int, block_id: int) -> None:
        self.inner.on_block_evicted(block_hash, block_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: Mapping[str, Request]) -> FaultInjectionMetadata | None:
        meta = self.inner.build_connector_meta(scheduler_output, requests)
        if meta is None:
            return None
        loads = meta.load_block_ids()
        if self.faults.fail_all:
            spoiled = set(loads)
        else:
            spoiled = {b for b in loads if self.rng.random() < self.faults.fail_prob}
        self.num_spoiled += len(spoiled)
        return FaultInjectionMetadata(inner=meta, spoiled_block_ids=spoiled)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.inner.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.inner.request_finished(request, block_ids)

    def take_expired(self, now: float) -> list[str]:
        return self.inner.take_expired(now)

    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    def release(self, request_ids: list[str]) -> list[str]:
        return self.inner.release(request_ids)
