"""The KV transport of prefill/decode disaggregation over Ray (the RayKVConnector's).

A producer engine's EngineCore actor is named after its ``engine_id`` in one namespace, so
a consumer anywhere in the cluster finds it from the ``kv_transfer_params`` of a finished
prefill; it hands out its worker actors (rank order), and it takes the consumer's
``release_kv`` once every consumer rank holds its copy. A rank's blocks travel one of two
ways (``kv_connector_extra_config["transport"]``, read by the consumer; a producer serves
both):
- ``"object_store"``: ``read_kv`` returns numpy arrays through Ray's object store
  (zero-copy on the reading node, then one copy into the cache);
- ``"rdt"``: Ray Direct Transport (``raylm.actors.kv_transfer.kv_rdt``): ``read_kv_tensors`` returns
  torch tensors that Ray sends out of band, over a Gloo (CPU) or NCCL (CUDA on both
  sides) pair made between the two ranks on the consumer's first pull from that rank.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import ray
import torch

from raylm.scheduler.config.kv_transfer_config import OBJECT_STORE, RDT

logger = logging.getLogger(__name__)

KV_NAMESPACE = "raylm-kv"


def engine_actor_name(engine_id: str) -> str:
    return f"raylm-engine-core:{engine_id}"


class RayKVTransport:
    """``raylm.runner.kv_transfer.ray_pd.KVTransport`` over named actors. With ``"rdt"`` it
    must be built in the consuming rank's actor (the refs' owner and the tensors'
    receiver); ``device`` gives where that rank's KV lives."""

    def __init__(self, transport: str = OBJECT_STORE,
                 device: Callable[[], torch.device] | None = None) -> None:
        if transport not in (OBJECT_STORE, RDT):
            raise ValueError(f"unknown KV transport {transport!r}")
        self.kind = transport
        self._workers: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._device = device or (lambda: torch.device("cpu"))
        # rdt: producer rank's actor id -> (pair name, its handle, KV kept on the device)
        self._pairs: dict[str, tuple[str, Any, bool]] = {}
        self._pair_lock = threading.Lock()
        if transport == RDT:
            from raylm.actors.kv_transfer import kv_rdt

            kv_rdt.register()
            self._me = ray.get_runtime_context().current_actor
            self._node_ip = ray.util.get_node_ip_address()

    def _engine(self, engine_id: str) -> Any:
        return ray.get_actor(engine_actor_name(engine_id), namespace=KV_NAMESPACE)

    def _worker(self, engine_id: str, rank: int, timeout_s: float) -> Any:
        with self._lock:
            workers = self._workers.get(engine_id)
        if workers is None:
            workers = ray.get(self._engine(engine_id).kv_worker_handles.remote(),
                              timeout=timeout_s)
            with self._lock:
                self._workers[engine_id] = workers
        return workers[rank]

    def fetch(self, engine_id: str, rank: int, request_id: str, first_block: int,
              head_lo: int, head_hi: int, timeout_s: float) -> dict[str, Any]:
        worker = self._worker(engine_id, rank, timeout_s)
        try:
            if self.kind == RDT:
                payload = self._fetch_rdt(worker, request_id, first_block, head_lo, head_hi,
                                          timeout_s)
            else:
                payload = ray.get(worker.read_kv.remote(request_id, first_block, head_lo,
                                                        head_hi), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            with self._lock:  # the producer is gone: look it up afresh next time
                self._workers.pop(engine_id, None)
            self._drop_pair(worker)
            raise
        payload["transport"] = self.kind
        return payload

    # ---- rdt ---------------------------------------------------------------------------
    def _fetch_rdt(self, worker: Any, request_id: str, first_block: int, head_lo: int,
                   head_hi: int, timeout_s: float) -> dict[str, Any]:
        from raylm.actors.kv_transfer import kv_rdt

        on_device = self._pair_with(worker, timeout_s)
        # The tensors stay on the producer until this rank's take_kv receives them.
        ref = worker.read_kv_tensors.options(tensor_transport=kv_rdt.TRANSPORT).remote(
            request_id, first_block, head_lo, head_hi, on_device)
        key = uuid.uuid4().hex
        try:
            ray.get(self._me.take_kv.remote(key, ref), timeout=timeout_s)
        except Exception:
            kv_rdt.abandon(key)
            raise
        payload = kv_rdt.take_landed(key)
        if "error" in payload:  # the producer could not read it (released, or not held)
            raise RuntimeError(payload["error"])
        return payload

    def _pair_with(self, worker: Any, timeout_s: float) -> bool:
        """Make this rank's pair with the producer rank on first use; whether the KV stays
        on the device (NCCL, CUDA on both sides) rather than going through host memory."""
        from raylm.actors.kv_transfer import kv_rdt
        from raylm.parallel.rendezvous import StoreRendezvous

        peer = worker._actor_id.hex()
        with self._pair_lock:
            known = self._pairs.get(peer)
            if known is not None and kv_rdt.has_pair(known[0]):
                return known[2]
            device = self._device()
            on_device = device.type == "cuda" and ray.get(worker.kv_device.remote(),
                                                          timeout=timeout_s) == "cuda"
            backend = "nccl" if on_device else "gloo"
            name = f"raylm-kv-pair-{uuid.uuid4().hex[:12]}"
            rendezvous = StoreRendezvous.publish(self._node_ip, 2, timeout_s)
            joined = worker.join_kv_pair.remote(name, rendezvous.host, rendezvous.port,
                                                backend, timeout_s)
            try:
                kv_rdt.join_pair(name, rendezvous.host, rendezvous.port, kv_rdt.DST, backend,
                                 timeout_s, device if on_device else torch.device("cpu"),
                                 self._node_ip, store=rendezvous.store)
                ray.get(joined, timeout=timeout_s)
            except Exception:
                kv_rdt.leave_pair(name)
                raise
            kv_rdt.add_route(peer, self._me._actor_id.hex(), name)
            self._pairs[peer] = (name, worker, on_device)
            return on_device

    def _drop_pair(self, worker: Any) -> None:
        with self._pair_lock:
            known = self._pairs.pop(worker._actor_id.hex(), None)
        if known is not None:
            from raylm.actors.kv_transfer import kv_rdt

            kv_rdt.leave_pair(known[0])

    def close(self) -> None:
        """Leave every pair, both sides (the producer's side fire and forget)."""
        with self._pair_lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        if not pairs:
            return
        from raylm.actors.kv_transfer import kv_rdt

        for name, worker, _ in pairs:
            kv_rdt.leave_pair(name)
            try:
                worker.leave_kv_pair.remote(name)
            except Exception as e:  # noqa: BLE001 - a producer that is gone left already
                logger.info("KV pair %s: the producer did not take the leave: %s", name, e)

    def release(self, engine_id: str, request_ids: list[str]) -> None:
        """Fire and forget: a producer that is gone has nothing left to free."""
        try:
            self._engine(engine_id).release_kv.remote(list(request_ids))
        except ValueError as e:  # no such actor any more
            logger.info("KV release of %s on engine %s: %s", request_ids, engine_id, e)
