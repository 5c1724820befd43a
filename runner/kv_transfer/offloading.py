"""OffloadingConnector, worker side: this rank's share of the host KV pool.

Each layer's host pool mirrors the device cache's block layout (``num_cpu_blocks`` blocks
of this rank's KV heads; pinned on CUDA). A step's orders run layer by layer, right
before the layer uses its cache: first the saves (evicted device blocks to their host
slots: one of them may be the block a load of this step writes into), then the loads
(host slots into device blocks). On CUDA they are queued on a copy stream at the start
of the step and each layer waits only for its own; on the CPU a layer's copies run when
it asks for them. Loads of ``load_async`` requests are reported in ``finished_recving``.
"""

from __future__ import annotations

import time

import torch

from raylm.runner.kv_transfer.base import KVCaches, KVConnectorWorker, layer_tensors
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import KVConnectorOutput
from raylm.scheduler.kv_transfer.offloading import OffloadingMetadata

GPU_TO_CPU = 'raylm:kv_offload_total_bytes{transfer_type="GPU_to_CPU"}'
CPU_TO_GPU = 'raylm:kv_offload_total_bytes{transfer_type="CPU_to_GPU"}'
TIME_GPU_TO_CPU = 'raylm:kv_offload_total_time{transfer_type="GPU_to_CPU"}'
TIME_CPU_TO_GPU = 'raylm:kv_offload_total_time{transfer_type="CPU_to_GPU"}'


class OffloadingConnectorWorker(KVConnectorWorker):
    def __init__(self, engine_config: EngineConfig, tp_rank: int = 0) -> None:
        super().__init__(engine_config, tp_rank)
        self.num_cpu_blocks = self.config.num_cpu_blocks
        self.host: list[tuple[torch.Tensor, ...]] = []  # per layer, its distinct tensors
        self._stream: torch.cuda.Stream | None = None
        self._events: list[torch.cuda.Event] = []
        self._pending_layers: set[int] = set()
        # This step's (save blocks, save slots, load slots, load blocks), set by start_load_kv.
        self._index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._finished_recving: set[str] = set()
        self._staged: list[torch.Tensor] = []

    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        super().register_kv_caches(kv_caches)
        pin = kv_caches[0][0].device.type == "cuda"

        def host_copy(cache: torch.Tensor) -> torch.Tensor:
            # The device cache may hold a scratch block past the pool: host blocks mirror the
            # pool's shape per block, not its length.
            return torch.zeros((self.num_cpu_blocks, *cache.shape[1:]), dtype=cache.dtype,
                               pin_memory=pin)

        self.host = [tuple(host_copy(t) for t in layer_tensors(layer)) for layer in kv_caches]
        if pin:
            self._stream = torch.cuda.Stream(kv_caches[0][0].device)

    # ---- per step --------------------------------------------------------------------
    def start_load_kv(self) -> None:
        meta = self.metadata
        if not isinstance(meta, OffloadingMetadata) or meta.is_empty():
            self._pending_layers = set()
            return
        device = self.kv_caches[0][0].device

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        save_blocks = index([b for b, _ in meta.saves])
        save_slots = torch.tensor([s for _, s in meta.saves], dtype=torch.long)
        load_slots = torch.tensor([s for s, _ in meta.loads], dtype=torch.long)
        load_blocks = index([b for _, b in meta.loads])
        self._index = (save_blocks, save_slots, load_slots, load_blocks)
        self._pending_layers = set(range(len(self.kv_caches)))
        self._t0 = time.perf_counter()
        if self._stream is not None:  # queue every layer's copies behind the compute stream
            self._stream.wait_stream(torch.cuda.current_stream())
            self._events = []
            with torch.cuda.stream(self._stream):
                for layer in range(len(self.kv_caches)):
                    self._copy_layer(layer)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    self._events.append(event)

    def has_step_loads(self) -> bool:
        return bool(self._pending_layers)

    def wait_for_layer_load(self, layer: int) -> None:
        if layer not in self._pending_layers:
            return
        self._pending_layers.discard(layer)
        if self._stream is not None:
            torch.cuda.current_stream().wait_event(self._events[layer])
        else:
            self._copy_layer(layer)
        meta = self.metadata
        self.spoil_loaded([b for _, b in meta.loads], range(layer, layer + 1))
        if not self._pending_layers:
            self._account(meta)

    def _copy_layer(self, layer: int) -> None:
        assert self._index is not None  # start_load_kv set it before any copy
        save_blocks, save_slots, load_slots, load_blocks = self._index
        for cache, host in zip(layer_tensors(self.kv_caches[layer]), self.host[layer],
                               strict=True):
            if save_slots.numel():  # blocking: done before this step writes the blocks
                host.index_copy_(0, save_slots, cache.index_select(0, save_blocks).cpu())
            if load_slots.numel():
                staged = host.index_select(0, load_slots)
                if cache.device.type == "cuda":
                    staged = staged.pin_memory()
                    self._staged.append(staged)  # alive until the copy stream is done
                cache.index_copy_(0, load_blocks, staged.to(cache.device, non_blocking=True))

    def _account(self, meta: OffloadingMetadata) -> None:
        per_block = sum(t.nbytes for layer in self.host for t in layer) // max(
            self.num_cpu_blocks, 1)
        seconds = time.perf_counter() - self._t0
        n = len(meta.saves) + len(meta.loads)
        if meta.saves:
            self.add_stat(GPU_TO_CPU, len(meta.saves) * per_block)
            self.add_stat(TIME_GPU_TO_CPU, seconds * len(meta.saves) / n)
        if meta.loads:
            self.add_stat(CPU_TO_GPU, len(meta.loads) * per_block)
            self.add_stat(TIME_CPU_TO_GPU, seconds * len(meta.loads) / n)
        self._finished_recving |= set(meta.async_loads)

    def finish_step(self, idle: bool = False) -> KVConnectorOutput | None:
        for layer in sorted(self._pending_layers):  # layers this rank did not run
            self.wait_for_layer_load(layer)
        if self._stream is not None and self._events:
            self._stream.synchronize()  # the staged copies are done: drop them
            self._events, self._staged = [], []
        return super().finish_step(idle)

    def get_finished(self) -> tuple[set[str], set[str]]:
        done, self._finished_recving = self._finished_recving, set()
        return set(), done
