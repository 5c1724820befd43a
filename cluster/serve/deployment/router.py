"""Ray Serve request routers for a model's replicas (``request_router`` in the deployment
config; docs/architecture.md §14).

``PrefixAwareRouter`` ("prefix"): every request's prompt is hashed in KV blocks
(cluster/serve/deployment/router_prompt.py) and matched against a mirror of what each replica was sent
(actors/prefix_affinity.py); the rule there picks: least loaded when the replicas' queues
differ by more than ``imbalance_threshold``, else the longest match, else a replica that
holds the request's LoRA adapter (Serve multiplexing of adapters), else the most free KV.
Each choice is a list of single-replica ranks, best first: Serve takes the first one whose
queue is not full, so a full favourite spills to the next. Serve's ``update_replicas`` adds
new replicas to the mirror (empty) and removes drained or dead ones, and every replica's
``record_routing_stats`` (its KV pool size and usage) arrives with it.

``Pow2Router`` ("pow2"): Serve's power of two choices, unchanged, plus the replica stats
and decision counts for ``/metrics`` that both routers publish (cluster/serve/deployment/router_stats.py).

The router lives where the deployment's handle is: the ingress replica. The mirror is that
router's own (no shared actor, so routing makes no extra Ray call); several ingress
replicas each keep one of the traffic they route.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from raylm.actors.prefix_affinity import (
    NO_PROMPT,
    AdapterResidency,
    AffinityRule,
    Candidate,
    PrefixIndex,
)
from raylm.cluster.serve.deployment.router_inflight import InflightCounts
from raylm.cluster.serve.deployment.router_prompt import PromptHasher
from raylm.cluster.serve.deployment.router_stats import RouterView, router_view

# Requests whose hashes and decision wait for on_request_routed; a request cancelled
# before it is routed never gets there, so the oldest go past this many.
_MAX_PENDING = 4096


@dataclass(frozen=True)
class _Routing:
    """What choose_replicas decided for a request, until on_request_routed says where
    it went: its prompt's hashes, the decision, each replica's match, its adapter."""

    hashes: list[int] | None = None
    decision: str = NO_PROMPT
    matched: dict[str, int] = field(default_factory=dict)
    adapter: str | None = None


class _PublishesStats:
    """Both routers: the replicas' routing stats and the decisions, into this process's
    RouterView of the deployment (the ingress's /metrics)."""

    _deployment_id: Any

    def _view(self) -> RouterView:
        return router_view(self._deployment_id.app_name, self._deployment_id.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]
        self._view().set_replicas({r.replica_id.unique_id: dict(r.routing_stats or {})
                                   for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]
        self._view().drop_replica(replica_id.unique_id)


def _is_model_request(pending_request: PendingRequest) -> bool:
    """A request for the model (LLMServer.handle), not the ingress's own calls to the
    replicas (/metrics scrapes, model cards, health): only those count as decisions."""
    return pending_request.metadata.call_method == "handle"


class Pow2Router(_PublishesStats, PowerOfTwoChoicesRequestRouter):
    """Serve's power of two choices, publishing what it sees."""

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        if _is_model_request(pending_request):
            self._view().count("pow2")


class PrefixAwareRouter(_PublishesStats, RequestRouter):
    """Prefix-cache affinity between a model's replicas, load first."""

    def initialize_state(self, llm_config: dict[str, Any] | None = None,
                         imbalance_threshold: float = 8.0, min_match_ratio: float = 0.1,
                         ttl_s: float = 600.0, **kwargs: Any) -> None:
        """``request_router_kwargs`` (request_router_config in app.py): the model's
        LLMConfig and the rule's knobs; ``hasher``: a ready PromptHasher (tests)."""
        hasher = kwargs.pop("hasher", None)
        if kwargs:
            raise ValueError(f"unknown PrefixAwareRouter arguments: {sorted(kwargs)}")
        if hasher is None:
            if llm_config is None:
                raise ValueError("PrefixAwareRouter needs llm_config (or a hasher).")
            hasher = PromptHasher(llm_config)
        self._hasher = hasher
        self._rule = AffinityRule(imbalance_threshold, min_match_ratio)
        self._index = PrefixIndex(ttl_s)
        self._adapters = AdapterResidency(hasher.adapters_per_replica)
        self._pending: OrderedDict[str, _Routing] = OrderedDict()
        self._inflight = InflightCounts()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._index.sync(r.replica_id.unique_id for r in replicas)
        self._adapters.sync(r.replica_id.unique_id for r in replicas)
        self._inflight.sync(r.replica_id.unique_id for r in replicas)
        for r in replicas:
            blocks = (r.routing_stats or {}).get("num_kv_blocks")
            if blocks:
                self._index.set_capacity(r.replica_id.unique_id, int(blocks))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.remove(replica_id.unique_id)
        self._adapters.sync(rid for rid in self._index.engines())
        self._inflight.sync(str(rid) for rid in self._index.engines())

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = self._hashes(pending_request)
        adapter = self._hasher.adapter(pending_request.args[1]) if pending_request is not None \
            and len(pending_request.args) >= 2 else None
        key = pending_request.metadata.internal_request_id if pending_request else None
        loads = {rid: max(n, float(self._inflight.load(rid, excluding=key)))
                 for rid, n in (await self._loads(candidate_replicas)).items()}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        matched = self._index.match(hashes or [], by_id)
        if hashes is None:
            decision = NO_PROMPT
            ranked = sorted(by_id, key=lambda rid: loads[rid])
        else:
            decision, keys = self._rule.rank(
                [Candidate(rid, loads[rid], matched[rid], _free_kv(r),
                           self._adapters.holds(rid, adapter))
                 for rid, r in by_id.items()], len(hashes))
            ranked = [str(k) for k in keys]
        if key is not None and ranked:
            self._inflight.choose(key, ranked[0])
        if pending_request is not None:
            self._remember(pending_request, _Routing(
                hashes, decision, {rid: n for rid, n in matched.items() if isinstance(rid, str)},
                adapter))
        return [[by_id[rid]] for rid in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        key = pending_request.metadata.internal_request_id
        routing = self._pending.pop(key, _Routing())
        rid = replica_id.unique_id
        self._inflight.route(key, rid)
        if result is not None:  # its completion, on any thread, frees the count
            loop = self._event_loop
            result.add_done_callback(
                lambda _: loop.call_soon_threadsafe(self._inflight.finish, rid))
        block = self._hasher.block_size
        if routing.hashes:
            self._index.insert(rid, routing.hashes)
        self._adapters.touch(rid, routing.adapter)
        if _is_model_request(pending_request):
            self._view().count(routing.decision, len(routing.hashes or ()) * block,
                               routing.matched.get(rid, 0) * block)

    # ---- internals --------------------------------------------------------------------
    def _hashes(self, pending_request: PendingRequest | None) -> list[int] | None:
        if pending_request is None:
            return None
        known = self._pending.get(pending_request.metadata.internal_request_id)
        if known is not None:  # a retry (replicas full): hashed already
            return known.hashes
        args = pending_request.args
        if len(args) < 2 or not isinstance(args[0], str):
            return None  # not LLMServer.handle(route, body): e.g. the HTTP proxy's request
        return self._hasher.hashes(args[0], args[1])

    def _remember(self, pending_request: PendingRequest, routing: _Routing) -> None:
        key = pending_request.metadata.internal_request_id
        self._pending[key] = routing
        self._pending.move_to_end(key)
        while len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, float]:
        """Each replica's ongoing requests: Serve's queue-length cache (the replicas' own
        answers, plus what this router sent since), probing those it lacks; a replica
        that does not answer counts as full."""
        loads: dict[str, float] = {}
        missing = []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                loads[r.replica_id.unique_id] = float(n)
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                loads[r.replica_id.unique_id] = (float(r.max_ongoing_requests) if n is None
                                                 else float(n))
        return loads


def _free_kv(replica: RunningReplica) -> float | None:
    usage = (replica.routing_stats or {}).get("kv_cache_usage_perc")
    if usage is None or not math.isfinite(float(usage)):
        return None
    return 1.0 - float(usage)


ROUTER_CLASSES = {"prefix": PrefixAwareRouter, "pow2": Pow2Router}
