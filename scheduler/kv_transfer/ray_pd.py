"""RayKVConnector, scheduler side: prefill/decode disaggregation between two engines.

Producer (prefill engine): a request sent with ``kv_transfer_params={"do_remote_decode":
True}`` runs its prompt as usual; the step that computes its last prompt chunk also tells
the workers its block table (``sends``), so they can serve reads of it as soon as the
step is back. When it finishes its blocks stay allocated (``request_finished`` delays the
free) until the consumer releases them (``finished_sending``, through
``EngineCore.release_kv``) or ``abort_timeout_s`` passes; its final output carries the
``kv_transfer_params`` a consumer needs.
Consumer (decode engine): a request with ``{"do_remote_prefill": True, ...}`` is admitted
with its whole prompt as external tokens, loaded asynchronously: it waits in
WAITING_FOR_REMOTE_KVS while the workers pull the blocks (``recvs``), and every step
names the receives still pending so all ranks agree when one is complete.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raylm.scheduler.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler

if TYPE_CHECKING:
    from raylm.scheduler.config.kv_transfer_config import KVTransferConfig
    from raylm.scheduler.core_outputs import KVConnectorOutput, SchedulerOutput
    from raylm.scheduler.request import Request

DEFAULT_ABORT_TIMEOUT_S = 120.0
EXPIRED = "raylm:kv_transfer_num_kv_expired_reqs"  # NIXL's name, a neutral prefix


@dataclass(frozen=True)
class RecvSpec:
    """Pull the peer's blocks ``first_block ..`` of its request into ``block_ids``."""

    remote_engine_id: str
    remote_request_id: str
    remote_tp_size: int
    first_block: int
    block_ids: list[int]


@dataclass
class RayKVMetadata(KVConnectorMetadata):
    sends: dict[str, list[int]] = field(default_factory=dict)  # producer: block tables
    unsends: set[str] = field(default_factory=set)  # producer: freed, serve no more reads
    recvs: dict[str, RecvSpec] = field(default_factory=dict)  # consumer: start these
    pending_recvs: list[str] = field(default_factory=list)  # consumer: not reported yet

    def load_block_ids(self) -> list[int]:
        return [b for spec in self.recvs.values() for b in spec.block_ids]

    def is_empty(self) -> bool:
        return not (self.sends or self.unsends or self.recvs or self.pending_recvs)


class RayKVConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, tp_size: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(config, block_size, **kwargs)
        self.tp_size = tp_size
        self.abort_timeout_s = float(config.extra("abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S))
        self._meta = RayKVMetadata()
        self._registered: set[str] = set()  # producer: requests whose table the workers hold
        self._sending: dict[str, float] = {}  # producer: finished, held since
        self._receiving: set[str] = set()  # consumer: pulls the workers have not reported
        self.stats.extra.update({EXPIRED: 0})

    # ---- consumer ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self.config.is_kv_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return max(count, 0), count > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        params = request.kv_transfer_params
        assert params is not None
        params["do_remote_prefill"] = False  # one pull: a later admission recomputes
        first = num_local_tokens // self.block_size
        last = -(-(num_local_tokens + num_external_tokens) // self.block_size)
        self._meta.recvs[request.request_id] = RecvSpec(
            remote_engine_id=str(params["remote_engine_id"]),
            remote_request_id=str(params["remote_request_id"]),
            remote_tp_size=int(params.get("remote_tp_size", 1)), first_block=first,
            block_ids=list(block_ids[first:last]))
        self._receiving.add(request.request_id)

    # ---- producer ------------------------------------------------------------------------
    def _sends_remote_decode(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return bool(self.config.is_kv_producer and params and params.get("do_remote_decode"))

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: Mapping[str, Request]) -> RayKVMetadata | None:
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or not self._sends_remote_decode(request):
                continue
            if request.num_computed_tokens + n >= request.num_prompt_tokens:
                # This step completes the prompt's KV: the workers learn the table now, so
                # a read may come as soon as the step (and so the request) is done.
                self._meta.sends[rid] = self.get_block_ids(rid)
                self._registered.add(rid)
        self._meta.pending_recvs = sorted(self._receiving - set(self._meta.recvs))
        meta, self._meta = self._meta, RayKVMetadata()
        return None if meta.is_empty() else meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if rid in self._receiving:
            return True, None  # a pull still writes into its blocks: wait for its report
        if not self._sends_remote_decode(request) or rid not in self._registered:
            self._unregister(rid)
            return False, None
        if request.get_finished_reason() not in ("stop", "length"):
            self._unregister(rid)  # aborted or failed: nobody will pull it
            return False, None
        self._sending[rid] = time.monotonic()
        return True, {"do_remote_prefill": True, "remote_engine_id": self.config.engine_id,
                      "remote_request_id": rid, "remote_tp_size": self.tp_size,
                      "remote_block_size": self.block_size}

    def _unregister(self, rid: str) -> None:
        if rid in self._registered:
            self._registered.discard(rid)
            self._meta.unsends.add(rid)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending:
            self._sending.pop(rid, None)
            self._unregister(rid)
        self._receiving -= output.finished_recving

    def take_expired(self, now: float) -> list[str]:
        expired = [rid for rid, since in self._sending.items()
                   if now - since > self.abort_timeout_s]
        for rid in expired:
            del self._sending[rid]
            self._unregister(rid)
            self.stats.extra[EXPIRED] += 1
        return expired

    def release(self, request_ids: list[str]) -> list[str]:
        """The consumer has its copy: the ids among ``request_ids`` that were held."""
        released = [rid for rid in request_ids if rid in self._sending]
        for rid in released:
            del self._sending[rid]
            self._unregister(rid)
        return released

    def has_pending_work(self) -> bool:
        return bool(self._receiving or self._meta.unsends)
