"""RayKVConnector, worker side: a prefill rank serves its blocks, a decode rank pulls them.

Producer: the step that completes a prompt registers the request's block table
(``sends``); ``read_blocks`` (called from another thread by the rank's actor) copies the
blocks' KV heads it is asked for while the table is registered, under a lock the step
thread takes to unregister it (``unsends``), so a read never races the blocks' reuse.
Consumer: each new receive is pulled by a background thread through the injected
``KVTransport`` (the peer's ranks over Ray: its object store, or Ray Direct Transport),
one read per peer rank holding some of this rank's KV heads (re-sharding when the two
sides' TP sizes differ). The KV is written into the cache on the step thread (the one
that makes the rank's torch calls), and a receive is complete once every rank has
written its share: all ranks reduce their flags over the TP group at the same steps
(every pending receive is named in every step's metadata).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from raylm.runner.kv_transfer.base import KVConnectorWorker, layer_tensors
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.kv_transfer.ray_pd import RayKVMetadata, RecvSpec

logger = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT_S = 60.0
# How long a step that ran nothing waits for a pull to land (the engine would otherwise
# send empty steps back to back while it only waits for KV).
IDLE_WAIT_S = 0.005
# NIXL's counters (vLLM), with a prefix that does not name a transport.
BYTES = "raylm:kv_transfer_bytes_transferred"
SECONDS = "raylm:kv_transfer_xfer_time_seconds"
FAILED = "raylm:kv_transfer_num_failed_transfers"
# raylm's: the bytes by the way they came (which transport the pulls really took).
BYTES_BY_TRANSPORT = 'raylm:kv_connector_transfer_bytes{{transport="{}"}}'


class KVTransport(Protocol):
    """How a consumer rank reaches a producer engine (implemented in raylm.actors)."""

    def fetch(self, engine_id: str, rank: int, request_id: str, first_block: int,
              head_lo: int, head_hi: int, timeout_s: float) -> dict[str, Any]: ...

    def release(self, engine_id: str, request_ids: list[str]) -> None: ...

    def close(self) -> None: ...


def kv_head_range(rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """The global KV heads a TP rank holds (one replicated head when TP exceeds them)."""
    if tp_size >= num_kv_heads:
        head = rank // (tp_size // num_kv_heads)
        return head, head + 1
    per = num_kv_heads // tp_size
    return rank * per, (rank + 1) * per


def head_sources(lo: int, hi: int, peer_tp: int, num_kv_heads: int
                 ) -> list[tuple[int, int, int]]:
    """(peer rank, first head, end head) reads that cover global heads [lo, hi)."""
    out: list[tuple[int, int, int]] = []
    for head in range(lo, hi):
        rank = next(r for r in range(peer_tp)
                    if kv_head_range(r, peer_tp, num_kv_heads)[0] <= head
                    < kv_head_range(r, peer_tp, num_kv_heads)[1])
        if out and out[-1][0] == rank and out[-1][2] == head:
            out[-1] = (rank, out[-1][1], head + 1)
        else:
            out.append((rank, head, head + 1))
    return out


def pack(array: np.ndarray, dtype: torch.dtype) -> dict[str, Any]:
    return {"data": array, "dtype": str(dtype).removeprefix("torch.")}


def unpack(payload: dict[str, Any]) -> torch.Tensor:
    """[layers, 2, blocks, heads, block_size, head_dim] as the sender's dtype."""
    dtype = getattr(torch, payload["dtype"])
    data = payload["data"]
    if not isinstance(data, torch.Tensor):  # the object store's read-only numpy view
        data = torch.from_numpy(np.array(data))  # a writable copy
    return data.view(dtype) if data.dtype != dtype else data


@dataclass
class _Recv:
    spec: RecvSpec
    future: Future  # the peer's payloads, one per source read
    spoiled: set[int]
    failed_from: int | None = None  # set once written on the step thread
    started: float = 0.0


class RayKVConnectorWorker(KVConnectorWorker):
    def __init__(self, engine_config: EngineConfig, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: Any = None) -> None:
        super().__init__(engine_config, tp_rank)
        self.tp_size = tp_size
        self.tp_group = tp_group
        hf = engine_config.model_config.hf_config
        # Latent attention caches one row per token, whole on every TP rank.
        self.num_kv_heads = 1 if "kv_lora_rank" in hf else int(
            hf.get("num_key_value_heads", hf.get("num_attention_heads", 1)))
        self.head_lo, self.head_hi = kv_head_range(tp_rank, tp_size, self.num_kv_heads)
        self.fetch_timeout_s = float(self.config.extra("fetch_timeout_s",
                                                       DEFAULT_FETCH_TIMEOUT_S))
        self.transport: KVTransport | None = None  # injected by the rank's actor
        self._sends: dict[str, list[int]] = {}
        self._sends_lock = threading.Lock()
        self._recvs: dict[str, _Recv] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="raylm-kv-pull")
        self._invalid: set[int] = set()

    # ---- producer ------------------------------------------------------------------------
    def _gather(self, request_id: str, first_block: int, head_lo: int, head_hi: int,
                on_device: bool) -> torch.Tensor:
        """The request's blocks from ``first_block`` on, global KV heads [head_lo, head_hi)
        of this rank, in host memory unless ``on_device``; raises KeyError once the
        request is no longer held here."""
        lo, hi = head_lo - self.head_lo, head_hi - self.head_lo
        if lo < 0 or hi > self.head_hi - self.head_lo:
            raise ValueError(f"heads [{head_lo}, {head_hi}) are not on rank {self.tp_rank}")
        with self._sends_lock:
            block_ids = self._sends[request_id][first_block:]
            index = torch.tensor(block_ids, dtype=torch.long)
            layers = []
            for kv in self.kv_caches:  # key and value, or a latent layer's one tensor
                index = index.to(kv[0].device)
                layer = torch.stack([t.index_select(0, index)[:, lo:hi]
                                     for t in layer_tensors(kv)])
                layers.append(layer if on_device else layer.cpu())
        return torch.stack(layers)

    def read_blocks(self, request_id: str, first_block: int, head_lo: int, head_hi: int
                    ) -> dict[str, Any]:
        """``_gather`` as numpy, for the object store (bfloat16 travels as int16)."""
        stacked = self._gather(request_id, first_block, head_lo, head_hi, on_device=False)
        dtype = stacked.dtype
        if dtype == torch.bfloat16:
            stacked = stacked.view(torch.int16)
        return pack(stacked.numpy(), dtype)

    def read_block_tensors(self, request_id: str, first_block: int, head_lo: int,
                           head_hi: int, on_device: bool) -> dict[str, Any]:
        """``_gather`` as a torch tensor, for Ray Direct Transport; a read that fails is
        reported in the value (``error``), not raised."""
        try:
            stacked = self._gather(request_id, first_block, head_lo, head_hi, on_device)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which recomputes
            return {"error": f"KV read of {request_id} on rank {self.tp_rank}: "
                             f"{type(e).__name__}: {e}"}
        return {"data": stacked, "dtype": str(stacked.dtype).removeprefix("torch.")}

    # ---- per step ------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        meta = self.metadata
        if not isinstance(meta, RayKVMetadata):
            return
        if meta.sends or meta.unsends:
            with self._sends_lock:  # waits for a read in progress
                self._sends.update({rid: list(b) for rid, b in meta.sends.items()})
                for rid in meta.unsends:
                    self._sends.pop(rid, None)
        for rid, spec in meta.recvs.items():
            spoiled = self._spoil & set(spec.block_ids)
            self._recvs[rid] = _Recv(spec, self._pool.submit(self._pull, spec), spoiled,
                                     started=time.perf_counter())

    def _pull(self, spec: RecvSpec) -> list[tuple[int, dict[str, Any]]]:
        """Background thread: the peer's payloads for this rank's heads (no torch call)."""
        if self.transport is None:
            raise RuntimeError("RayKVConnector consumer has no KV transport")
        return [(lo, self.transport.fetch(spec.remote_engine_id, rank, spec.remote_request_id,
                                          spec.first_block, lo, hi, self.fetch_timeout_s))
                for rank, lo, hi in head_sources(self.head_lo, self.head_hi,
                                                 spec.remote_tp_size, self.num_kv_heads)]

    def _write(self, recv: _Recv) -> int:
        """Step thread: write a landed pull into the cache; the index of its first block
        that did not load (its length when all did)."""
        block_ids = recv.spec.block_ids
        failed_from = len(block_ids)
        try:
            payloads = recv.future.result()
        except Exception as e:  # noqa: BLE001 - the peer is gone or refused: recompute
            logger.warning("KV pull of %s failed: %s", recv.spec.remote_request_id, e)
            self.add_stat(FAILED, 1)
            return 0
        for head_lo, payload in payloads:
            data = unpack(payload)
            n = min(data.shape[2], len(block_ids))
            failed_from = min(failed_from, n)
            index = torch.tensor(block_ids[:n], dtype=torch.long)
            lo, hi = head_lo - self.head_lo, head_lo - self.head_lo + data.shape[3]
            for kv, layer in zip(self.kv_caches, data, strict=True):
                index = index.to(kv[0].device)
                for cache, part in zip(layer_tensors(kv), layer, strict=True):
                    cache[index, lo:hi] = part[:n].to(cache.device)
            nbytes = data.numel() * data.element_size()
            self.add_stat(BYTES, nbytes)
            self.add_stat(BYTES_BY_TRANSPORT.format(payload.get("transport", "object_store")),
                          nbytes)
        self.add_stat(SECONDS, time.perf_counter() - recv.started)
        if recv.spoiled:
            self.write_garbage(sorted(recv.spoiled))
            failed_from = min([failed_from] + [block_ids.index(b) for b in recv.spoiled])
        return failed_from

    def get_finished(self) -> tuple[set[str], set[str]]:
        meta = self.metadata
        if not isinstance(meta, RayKVMetadata):
            return set(), set()
        # A receive every rank completed may still be named by steps scheduled before the
        # scheduler heard of it: all ranks dropped it at the same step, so all skip it.
        names = sorted(r for r in set(meta.pending_recvs) | set(meta.recvs) if r in self._recvs)
        if not names:
            return set(), set()
        if self.idle:
            wait([self._recvs[r].future for r in names], timeout=IDLE_WAIT_S,
                 return_when=FIRST_COMPLETED)
        for rid in names:
            recv = self._recvs[rid]
            if recv.failed_from is None and recv.future.done():
                recv.failed_from = self._write(recv)
        done, failed_from = self._agree(names)
        finished = set()
        for rid, ok, first_bad in zip(names, done, failed_from, strict=True):
            if not ok:
                continue
            recv = self._recvs.pop(rid)
            finished.add(rid)
            self._invalid.update(recv.spec.block_ids[first_bad:])
            if self.tp_rank == 0 and self.transport is not None:
                # Every rank has its copy: the producer may free the blocks.
                self.transport.release(recv.spec.remote_engine_id,
                                       [recv.spec.remote_request_id])
        return set(), finished

    def _agree(self, names: list[str]) -> tuple[list[bool], list[int]]:
        """Across the TP group: a receive is done when every rank wrote it, and it failed
        from the first block any rank failed at."""
        n = len(names)
        recvs = [self._recvs[r] for r in names]
        local = [1 if recv.failed_from is not None else 0 for recv in recvs]
        first = [recv.failed_from if recv.failed_from is not None
                 else len(recv.spec.block_ids) for recv in recvs]
        if self.tp_size == 1 or self.tp_group is None:
            return [bool(x) for x in local], first
        import torch.distributed as dist

        device = "cuda" if self.kv_caches[0][0].is_cuda else "cpu"
        flags = torch.tensor(local + first, dtype=torch.long, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.tp_group)
        values = flags.tolist()
        return [bool(x) for x in values[:n]], values[n:]

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.transport is not None:
            self.transport.close()
