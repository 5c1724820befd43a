"""A fake worker side of the KV connectors for the fake runner (sched_fake_executor.py).

It plays the orders of the real connectors' scheduler side on the fake KV (one (token,
position) pair per slot): the offload tier's saves and loads through a fake host pool,
the prefill/decode pull from a fake peer that holds each prompt's right KV. Loads the fault
injector spoiled leave garbage and are reported in ``invalid_block_ids``; asynchronous
loads are reported ``delay_steps`` steps late (each a random delay up to it).
"""

from __future__ import annotations

import random

from raylm.scheduler.core_outputs import KVConnectorOutput, SchedulerOutput
from raylm.scheduler.kv_transfer.fault_injection import FaultInjectionMetadata
from raylm.scheduler.kv_transfer.offloading import OffloadingMetadata
from raylm.scheduler.kv_transfer.ray_pd import RayKVMetadata

GARBAGE = ("garbage", -1)


class FakeKVWorker:
    def __init__(self, num_cpu_blocks: int = 0, delay_steps: int = 0, seed: int = 0,
                 peer_prompts: dict[str, list[int]] | None = None) -> None:
        self.host: list[list | None] = [None] * num_cpu_blocks
        self.delay_steps = delay_steps
        self.rng = random.Random(seed)
        # Prefill/decode: the peer's request id -> its prompt (the peer's KV is right).
        self.peer_prompts = peer_prompts or {}
        self._pending: list[tuple[int, str]] = []  # (report at step, request id)
        self._spoiled: set[int] = set()
        self.num_loaded_blocks = 0
        self.num_spoiled = 0
        # Tokens a correct roll-back recomputes: settled past the first failed block.
        self.expected_lost = 0
        self.sends: dict[str, list[int]] = {}  # producer: registered block tables

    def before_step(self, so: SchedulerOutput, runner) -> set[int]:
        """Apply this step's orders to the runner's fake KV; the blocks left garbage."""
        meta = so.kv_connector_metadata
        spoiled: set[int] = set()
        if isinstance(meta, FaultInjectionMetadata):
            spoiled = set(meta.spoiled_block_ids)
            meta = meta.inner
        self._spoiled = spoiled
        if isinstance(meta, OffloadingMetadata):
            for block_id, slot in meta.saves:  # saves first: a load may reuse the block
                self.host[slot] = list(runner.kv[block_id])
            for slot, block_id in meta.loads:
                content = self.host[slot]
                assert content is not None, f"load of empty host slot {slot}"
                runner.kv[block_id] = list(content)
            self.num_loaded_blocks += len(meta.loads)
            self._delay(so.step_id, meta.async_loads)
        elif isinstance(meta, RayKVMetadata):
            for rid, blocks in meta.sends.items():
                self.sends[rid] = list(blocks)
            for rid in meta.unsends:
                self.sends.pop(rid, None)
            for spec in meta.recvs.values():
                prompt = self.peer_prompts[spec.remote_request_id]
                bs = runner.block_size
                for i, block_id in enumerate(spec.block_ids):
                    first = (spec.first_block + i) * bs
                    runner.kv[block_id] = [(prompt[p], p) if p < len(prompt) else None
                                           for p in range(first, first + bs)]
                self.num_loaded_blocks += len(spec.block_ids)
            self._delay(so.step_id, meta.recvs)
        for block_id in spoiled:
            runner.kv[block_id] = [GARBAGE] * runner.block_size
        self.num_spoiled += len(spoiled)
        self._count_async_losses(meta, spoiled, runner.block_size)
        return spoiled

    def _count_async_losses(self, meta, spoiled: set[int], block_size: int) -> None:
        """An asynchronous load computes nothing: it loses what it loaded from its first
        failed block on (a synchronous one is counted by the runner, which computes on it)."""
        loads: list[tuple[list[int], int]] = []  # (block ids, tokens they hold from the first)
        if isinstance(meta, OffloadingMetadata):
            loads = [(b, len(b) * block_size) for b in meta.async_loads.values()]
        elif isinstance(meta, RayKVMetadata):
            loads = [(spec.block_ids, len(self.peer_prompts[spec.remote_request_id])
                      - spec.first_block * block_size) for spec in meta.recvs.values()]
        for blocks, num_tokens in loads:
            bad = [i for i, b in enumerate(blocks) if b in spoiled]
            if bad:
                self.expected_lost += num_tokens - bad[0] * block_size

    def _delay(self, step_id: int, request_ids) -> None:
        for rid in request_ids:
            delay = self.rng.randint(0, self.delay_steps) if self.delay_steps else 0
            self._pending.append((step_id + delay, rid))

    def after_step(self, so: SchedulerOutput, runner) -> KVConnectorOutput | None:
        done = {rid for at, rid in self._pending if at <= so.step_id}
        self._pending = [(at, rid) for at, rid in self._pending if at > so.step_id]
        if not (done or self._spoiled):
            return None
        return KVConnectorOutput(finished_recving=done, invalid_block_ids=set(self._spoiled))
