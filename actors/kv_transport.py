"""The KV transport of prefill/decode disaggregation over Ray (the RayKVConnector's).

A producer engine's EngineCore actor is named after its ``engine_id`` in one namespace, so
a consumer anywhere in the cluster finds it from the ``kv_transfer_params`` of a finished
prefill; it hands out its worker actors (rank order), whose ``read_kv`` returns a rank's
blocks through Ray's object store (zero-copy numpy on the reading node), and it takes
the consumer's ``release_kv`` once every consumer rank holds its copy.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

logger = logging.getLogger(__name__)

KV_NAMESPACE = "raylm-kv"


def engine_actor_name(engine_id: str) -> str:
    return f"raylm-engine-core:{engine_id}"


class RayKVTransport:
    """``raylm.runner.kv_transfer.ray_pd.KVTransport`` over named actors."""

    def __init__(self) -> None:
        self._workers: dict[str, list[Any]] = {}
        self._lock = threading.Lock()

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
            return ray.get(worker.read_kv.remote(request_id, first_block, head_lo, head_hi),
                           timeout=timeout_s)
        except ray.exceptions.RayActorError:
            with self._lock:  # the producer is gone: look it up afresh next time
                self._workers.pop(engine_id, None)
            raise

    def release(self, engine_id: str, request_ids: list[str]) -> None:
        """Fire and forget: a producer that is gone has nothing left to free."""
        try:
            self._engine(engine_id).release_kv.remote(list(request_ids))
        except ValueError as e:  # no such actor any more
            logger.info("KV release of %s on engine %s: %s", request_ids, engine_id, e)
