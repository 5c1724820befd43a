"""The worker side of a KV connector (vLLM V1's split): moves the bytes it is told to.

One per rank. The runner registers the rank's KV caches, binds each step's metadata (the
scheduler side's orders) before the forward and calls ``start_load_kv``; the attention of
layer i calls ``wait_for_layer_load(i)`` before it touches the cache and ``save_kv_layer(i)``
after writing it; after the step ``finish_step`` reports what finished sending or
receiving and which blocks failed to load (``KVConnectorOutput``).

Fault injection (``FaultInjectionMetadata``) is handled here for every connector: blocks
the scheduler side named are overwritten with garbage right after they load and reported
failed, and completions of asynchronous loads are held back ``delay_steps`` steps.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import KVConnectorOutput
from raylm.scheduler.kv_transfer.fault_injection import FaultInjectionMetadata

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key, value


def layer_tensors(layer: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A layer's distinct cache tensors: key and value, or the one latent cache that a
    latent-attention layer registers as both (runner/models/mla.py)."""
    return layer[:1] if layer[0] is layer[1] else layer


class KVConnectorWorker:
    def __init__(self, engine_config: EngineConfig, tp_rank: int = 0) -> None:
        kv = engine_config.kv_transfer_config
        assert kv is not None
        self.config = kv
        self.tp_rank = tp_rank
        self.block_size = engine_config.cache_config.block_size
        self.kv_caches: KVCaches = []
        self.metadata: Any = None
        faults = kv.fault_injection
        self.delay_steps = faults.delay_steps if faults is not None else 0
        # Seeded alike on every rank: they hold back the same completions.
        self._delay_rng = random.Random(faults.seed if faults is not None else 0)
        self._spoil: set[int] = set()
        self._failed: set[int] = set()
        self._held: list[tuple[int, str]] = []  # (steps left, request) held back
        self.stats: dict[str, float] = {}
        self.idle = False  # the current step ran nothing (see finish_step)

    # ---- setup -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        self.kv_caches = kv_caches

    @property
    def cache_device(self) -> torch.device:
        """Where the KV caches live (registered by initialize_kv_cache)."""
        if not self.kv_caches:
            raise RuntimeError("the KV caches are not registered yet.")
        return self.kv_caches[0][0].device

    # ---- per step --------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Any) -> None:
        if isinstance(metadata, FaultInjectionMetadata):
            self._spoil = set(metadata.spoiled_block_ids)
            metadata = metadata.inner
        else:
            self._spoil = set()
        self.metadata = metadata

    def start_load_kv(self) -> None:
        """Before the forward: start this step's loads (and whatever must precede its
        writes)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Before layer ``layer`` reads or writes its cache."""

    def save_kv_layer(self, layer: int) -> None:
        """After layer ``layer`` wrote this step's KV."""

    def has_step_loads(self) -> bool:
        """Whether this step's forward must run eagerly (its layers wait for loads)."""
        return False

    def finish_step(self, idle: bool = False) -> KVConnectorOutput | None:
        """After the step: what the scheduler side must hear (None: nothing). ``idle``: the
        step ran nothing (the engine only waits for transfers), so a connector may wait a
        little for one to complete rather than have the engine spin on empty steps."""
        self.idle = idle
        sending, recving = self.get_finished()
        recving = self._hold_back(recving)
        failed, self._failed = self._failed | self.get_block_ids_with_load_errors(), set()
        stats, self.stats = self.stats, {}
        self.metadata = None
        if not (sending or recving or failed or stats):
            return None
        return KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                 invalid_block_ids=failed, stats=stats)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose sends / asynchronous loads completed since the last call."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    # ---- helpers for the connectors ----------------------------------------------------
    def spoil_loaded(self, block_ids: list[int], layers: range | None = None) -> None:
        """Fault injection: the named blocks among ``block_ids`` just loaded; make them
        garbage (in ``layers``, default all) and report them failed."""
        bad = [b for b in block_ids if b in self._spoil]
        if bad:
            self.write_garbage(bad, layers)
            self._failed.update(bad)

    def write_garbage(self, block_ids: list[int], layers: range | None = None) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.cache_device)
        for i in layers if layers is not None else range(len(self.kv_caches)):
            for cache in self.kv_caches[i]:
                cache.index_fill_(0, index, 1e3)

    def _hold_back(self, recving: set[str]) -> set[str]:
        if not self.delay_steps and not self._held:
            return recving
        for rid in sorted(recving):
            self._held.append((self._delay_rng.randint(0, self.delay_steps), rid))
        ready = {rid for left, rid in self._held if left <= 0}
        self._held = [(left - 1, rid) for left, rid in self._held if left > 0]
        return ready

    def add_stat(self, key: str, value: float) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + value

    def shutdown(self) -> None:
        pass
