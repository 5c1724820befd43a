"""RayEngineCoreClient: the EngineCoreClient protocol over d >= 1 EngineCore actors.

Same synchronous API as ``InprocEngineCoreClient``, whatever data_parallel_size d is. Each
rank is an EngineCoreActor in a placement group of its own, or in its slice of the Serve
replica's group. With d > 1 a DPCoordinator starts waves on the ranks and a DPLoadBalancer
routes each new request (to the rank that most likely holds its prompt's prefix while the
ranks' loads are balanced, else to the least loaded: docs/architecture.md §14). One long
poll per rank is in flight (``RankOutputPolls``), read by the caller of ``get_output`` or by
the awaiting ``get_output_async``; a dead rank becomes one EngineDeadError that every later
read and call raises, once the outputs the ranks sent before it are read.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import ray
from ray.util.placement_group import get_current_placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.actors.dp_coordinator import DPCoordinator, DPLoadBalancer
from raylm.actors.engine_core_actor import EngineCoreActor, model_in_rank_actor
from raylm.actors.kv_transfer.kv_transport import KV_NAMESPACE, engine_actor_name
from raylm.actors.placement import (
    create_placement_group,
    default_worker_resource,
    ensure_ray_initialized,
    get_within,
    threads_for_cpus,
    worker_bundle,
)
from raylm.actors.prefix_affinity import prompt_block_hashes
from raylm.actors.rank_output_polls import Answer, RankOutputPolls
from raylm.actors.remote_engine import RemoteEngineCalls, as_engine_dead, submit
from raylm.parallel.dp_sync import DEFAULT_DP_TIMEOUT_S
from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import (
    EngineConfig,
    ParallelConfig,
    dp_rank_bundles,
    stage_bundles,
)
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutputs, SchedulerStats

if TYPE_CHECKING:
    from ray.actor import ActorClass

    from raylm.scheduler.request import Request

logger = logging.getLogger(__name__)

# Gauges averaged over ranks in get_metrics; every other number is summed.
_AVERAGED = ("raylm:kv_cache_usage_perc",)


def merge_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """One view of the ranks' latest stats: counts summed, KV usage averaged."""
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats))


def merge_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters and counts summed, KV usage averaged; the per-rank dicts under ``dp_ranks``."""
    merged: dict[str, Any] = {}
    # Every rank's keys: experts spread over the ranks are each counted on one rank only.
    keys = dict.fromkeys(key for metrics in per_rank for key in metrics)
    for key in keys:
        value = next(m[key] for m in per_rank if key in m)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total = sum(m.get(key, 0) for m in per_rank)
            merged[key] = total / len(per_rank) if key in _AVERAGED else total
    merged["dp_ranks"] = per_rank
    return merged


def rank_bundles(pc: ParallelConfig, engine: dict, worker: dict) -> list[dict]:
    """One rank's bundles: its EngineCore actor's, then one per pipeline stage; a DP rank
    that runs the model itself (``model_in_rank_actor``) has one, its device's."""
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    if pc.data_parallel_size == 1:
        return [dict(engine)] + stage_bundles(tp, pp, worker)
    return dp_rank_bundles(tp, pp, engine, worker)


@dataclass(frozen=True)
class RankSlot:
    """Where a rank's EngineCore actor runs: bundle ``bundle`` of ``group``, taking ``cpus``
    and ``gpus`` of it; the rank's workers take the bundles after it."""

    group: Any
    bundle: int
    cpus: float
    gpus: float


class _OneRank:
    """Routing with d = 1: everything to rank 0, nothing counted (the engine itself
    rejects a request id in use and hears every abort)."""

    def select(self, request_id: str, block_hashes: list[int] | None = None) -> int:
        return 0

    def finish(self, request_id: str) -> int:
        return 0

    def set_kv_usage(self, rank: int, usage: float) -> None:
        pass

    def owner(self, request_id: str) -> int:
        return 0


class RayEngineCoreClient(RemoteEngineCalls):
    def __init__(self, config: EngineConfig, *, resource: str | None = None,
                 cpus_per_rank: float = 1.0, cpus_per_worker: float = 1.0,
                 placement_timeout_s: float | None = None,
                 init_timeout_s: float = 600.0, poll_timeout_s: float = 0.5,
                 call_timeout_s: float = 60.0, dp_sync_timeout_s: float = DEFAULT_DP_TIMEOUT_S,
                 **executor_kwargs: Any) -> None:
        """``cpus_per_rank``: each EngineCore actor's CPUs (a DP rank that runs the model
        runs it on them); ``executor_kwargs`` go to each rank's RayExecutor."""
        pc = config.parallel_config
        self.config = config
        self.dp_size = pc.data_parallel_size
        self._who = "EngineCore actor" if self.dp_size == 1 else "DP rank actor"
        self.poll_timeout_s = poll_timeout_s
        self.call_timeout_s = call_timeout_s
        self.balancer: DPLoadBalancer | _OneRank = (
            DPLoadBalancer(self.dp_size) if self.dp_size > 1 else _OneRank())
        cache = config.cache_config
        # The ranks' prefix caches are what prefix-aware routing aims at.
        self._route_block_size = (cache.block_size if self.dp_size > 1
                                  and cache.enable_prefix_caching else None)
        self.slots: list[RankSlot] = []
        self._owns_placement_groups = True
        self.ranks: list[Any] = []
        self.coordinator: Any = None
        self.rank_infos: list[dict[str, Any]] = []
        # Batches read from the ranks and not yet handed out (a blocking reader takes one).
        self._ready: collections.deque[EngineCoreOutputs] = collections.deque()
        self._aborts: list[Any] = []  # abort calls sent, their answers not yet read
        self._latest_stats: dict[int, SchedulerStats] = {}
        self._stopped = threading.Event()
        self._init_death_tracking()
        # A local Ray this starts must hold every rank's bundles, were they all CPU ones.
        rank_cpus = cpus_per_rank + (0.0 if model_in_rank_actor(pc)
                                     else pc.world_size * cpus_per_worker)
        ensure_ray_initialized(self.dp_size * rank_cpus)
        try:
            self._init_placement(resource, cpus_per_rank, cpus_per_worker,
                                 placement_timeout_s or pc.placement_timeout_s)
            self._init_ranks(cpus_per_rank, executor_kwargs, init_timeout_s)
            if self.dp_size > 1:
                self._init_dp_group(pc.dp_sync_interval, dp_sync_timeout_s)
                for rank, info in enumerate(self.rank_infos):
                    self._dp_balancer().set_kv_capacity(rank, info["num_kv_blocks"])
        except BaseException:
            self._teardown()
            raise
        self._polls = RankOutputPolls(self.ranks, poll_timeout_s, call_timeout_s)
        self._polls.issue()

    @property
    def info(self) -> dict[str, Any]:
        """What rank 0's ``start`` reported (the only rank's, with d = 1)."""
        return self.rank_infos[0]

    @property
    def num_kv_blocks(self) -> int | None:
        """The KV pool in blocks, every rank's; None before the ranks have started."""
        if not self.rank_infos:
            return None
        return sum(int(info["num_kv_blocks"]) for info in self.rank_infos)

    # ---- startup ---------------------------------------------------------------------
    def _init_placement(self, resource: str | None, cpus_per_rank: float,
                        cpus_per_worker: float, timeout_s: float) -> None:
        pc = self.config.parallel_config
        per_rank = len(rank_bundles(pc, {}, {}))
        # A Serve replica's deployment reserved [replica] + d x [rank]: reserving groups of
        # our own would hold every CPU/GPU twice. With d = 1 the replica's bundle is the
        # rank's first: the EngineCore actor shares it and takes nothing of it.
        first = 0 if self.dp_size == 1 else 1
        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= first + self.dp_size * per_rank:
            self._owns_placement_groups = False
            for rank in range(self.dp_size):
                base = first + rank * per_rank
                spec = current.bundle_specs[base] if base else {}
                self.slots.append(RankSlot(current, base, spec.get("CPU", 0.0),
                                           spec.get("GPU", 0.0)))
            return
        # A rank that runs the model has one bundle, which its actor's CPUs size.
        worker = worker_bundle(resource or default_worker_resource(),
                               cpus_per_rank if model_in_rank_actor(pc) else cpus_per_worker)
        bundles = rank_bundles(pc, {"CPU": float(cpus_per_rank)}, worker)
        for rank in range(self.dp_size):
            pg = create_placement_group(bundles, pc.placement_group_strategy, timeout_s)
            self.slots.append(RankSlot(pg, 0, bundles[0].get("CPU", 0.0),
                                       bundles[0].get("GPU", 0.0)))
            logger.info("EngineCore rank %d placement group: %s", rank, bundles)

    def _init_ranks(self, cpus_per_rank: float, executor_kwargs: dict[str, Any],
                    timeout_s: float) -> None:
        if self.dp_size > 1:
            self.coordinator = DPCoordinator.remote(self.dp_size)
        env = envs.forwarded_to_actors()
        kv = self.config.kv_transfer_config
        # A prefill/decode peer finds this engine by its engine_id (actors/kv_transfer/kv_transport.py).
        named = ({"name": engine_actor_name(str(kv.engine_id)), "namespace": KV_NAMESPACE}
                 if kv is not None and not kv.is_offloading else {})
        for rank, slot in enumerate(self.slots):
            # mypy leaves class decorators out: the class is what @ray.remote made of it.
            actor_cls = cast("ActorClass[EngineCoreActor]", EngineCoreActor)
            self.ranks.append(actor_cls.options(
                num_cpus=slot.cpus, num_gpus=slot.gpus, **named,
                runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    slot.group, placement_group_bundle_index=slot.bundle),
            ).remote(self.config, rank, self.coordinator, slot.group,
                     threads_for_cpus(slot.cpus or cpus_per_rank), executor_kwargs,
                     bundle_offset=slot.bundle + 1))
        if self.coordinator is not None:
            ray.get(self.coordinator.register_ranks.remote(self.ranks), timeout=timeout_s)
        self.rank_infos = self._get([r.start.remote() for r in self.ranks], timeout_s,
                                    "starting the EngineCores")

    def _init_dp_group(self, sync_interval: int, timeout_s: float) -> None:
        host, port = self._get([self.ranks[0].publish_dp_rendezvous.remote(timeout_s)],
                               self.call_timeout_s, "publishing the DP rendezvous")[0]
        self._get([r.join_dp_group.remote(host, port, sync_interval, timeout_s)
                   for r in self.ranks], timeout_s + 30, "joining the DP Gloo group")

    def _get(self, refs: list, timeout_s: float, what: str) -> list:
        return get_within(refs, timeout_s, what, on=f"{self.dp_size} x {self._who}")

    # ---- EngineCoreClient protocol -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        """To the rank the DPLoadBalancer picks. Raises ValueError when the request can
        never be served, EngineDeadError if the engine is dead."""
        rank = self._route(request)
        try:
            # Synchronous: the rank's ValueError reaches the caller, and a later abort
            # cannot overtake the add on the (threaded, so unordered) actor.
            self._call(submit(self.ranks[rank].add_request, request), "add_request")
        except BaseException:
            self.balancer.finish(request.request_id)
            raise

    async def add_request_async(self, request: Request) -> None:
        """``add_request``, awaited: the caller's next call (an abort) waits for it too."""
        rank = self._route(request)
        try:
            await self._call_async(submit(self.ranks[rank].add_request, request),
                                   "add_request")
        except BaseException:
            self.balancer.finish(request.request_id)
            raise

    def _route(self, request: Request) -> int:
        self._check_not_dead()
        hashes = None
        if self._route_block_size is not None:
            lora = request.lora_request  # an adapter's blocks are its own
            hashes = prompt_block_hashes(request.prompt_token_ids, self._route_block_size,
                                         None if lora is None else lora.lora_name)
        return self.balancer.select(request.request_id, hashes)

    def abort_requests(self, request_ids: list[str]) -> None:
        """To each request's rank, without waiting (an event loop calls this); with d > 1
        ids already finished are dropped here. A failed abort is found by the next read
        of the outputs, as the engine's death."""
        self._check_not_dead()
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.balancer.owner(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            self._aborts.append(submit(self.ranks[rank].abort_requests, ids))

    def _reap_aborts(self) -> None:
        if not self._aborts:
            return
        done, self._aborts = ray.wait(self._aborts, num_returns=len(self._aborts), timeout=0)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError as e:
                self._call_error(e, "abort_requests")

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next batch of any rank (each rank's in its order); None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            self._check_not_dead()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._take_answers(self._polls.wait(left))
            if not self._ready and deadline is not None and time.monotonic() >= deadline:
                return None
        return self._ready.popleft()

    async def get_output_async(self) -> list[EngineCoreOutputs]:
        """Every batch the ranks have sent, awaiting the first."""
        while not self._ready:
            self._check_not_dead()
            self._take_answers(await self._polls.wait_async())
        batches = list(self._ready)
        self._ready.clear()
        return batches

    def get_metrics(self) -> dict[str, Any]:
        per_rank = self._call([submit(r.get_metrics) for r in self.ranks], "get_metrics")
        if self.dp_size == 1:
            return per_rank[0]
        merged = merge_metrics(per_rank)
        merged["raylm:dp_num_waves"] = per_rank[0]["dp"]["num_waves_completed"]
        merged["dp_unfinished_requests"] = self._dp_balancer().num_unfinished()
        merged["dp_routed_requests"] = self._dp_balancer().num_routed()
        merged["dp_routing_decisions"] = self._dp_balancer().decisions()
        return merged

    def release_kv(self, request_ids: list[str]) -> None:
        """Prefill/decode: free finished requests' KV that no decode engine will pull."""
        self._call([submit(r.release_kv, request_ids) for r in self.ranks], "release_kv")

    def get_dp_state(self) -> dict[str, Any]:
        """Waves and routing (d > 1): per-rank loop stats, the coordinator's view, the
        balancer's."""
        if self.coordinator is None:
            raise ValueError("get_dp_state needs data_parallel_size > 1.")
        return {"ranks": self._call([r.get_dp_stats.remote() for r in self.ranks], "get_dp_stats"),
                "coordinator": self._call(self.coordinator.get_state.remote(), "get_state"),
                "unfinished": self._dp_balancer().num_unfinished(),
                "routed": self._dp_balancer().num_routed(),
                "decisions": self._dp_balancer().decisions()}

    def check_health(self) -> None:
        self._check_not_dead()
        self._call([submit(r.check_health) for r in self.ranks], "check_health")

    def shutdown(self) -> None:
        """Idempotent; after Ray itself has shut down (interpreter exit) there is nothing
        left to release."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if not ray.is_initialized():
            return
        if self._dead is None and self.ranks:
            # Concurrently: a running DP rank leaves at its wave's next collective, which
            # needs every peer to reach it.
            try:
                ray.get([r.shutdown.remote() for r in self.ranks], timeout=self.call_timeout_s)
            except ray.exceptions.RayError as e:
                logger.warning("%s shutdown did not complete: %s", self._who, e)
        self._teardown()

    # ---- internals -----------------------------------------------------------------------
    def _dp_balancer(self) -> DPLoadBalancer:
        assert isinstance(self.balancer, DPLoadBalancer), "d = 1 routes nothing"
        return self.balancer

    def _take_answers(self, answers: list[Answer]) -> None:
        """Book the ranks' answers (finished requests, load, stats) and queue their batches;
        a failed poll or abort, or a poll overdue, is the engine's death."""
        self._reap_aborts()
        for rank, answer in answers:
            what = "get_outputs" if self.dp_size == 1 else f"get_outputs of DP rank {rank}"
            if isinstance(answer, BaseException):
                self._mark_dead(as_engine_dead(answer, self._who, what))
                continue
            if not self._stopped.is_set() and self._dead is None:
                self._polls.issue([rank])  # the next poll is under way while these are read
            for batch in answer:
                for out in batch.outputs:
                    if out.finished:
                        self.balancer.finish(out.request_id)
                if batch.scheduler_stats is not None:
                    self._latest_stats[rank] = batch.scheduler_stats
                    self.balancer.set_kv_usage(rank, batch.scheduler_stats.kv_cache_usage)
                    if self.dp_size > 1:
                        batch.scheduler_stats = merge_scheduler_stats(
                            list(self._latest_stats.values()))
                self._ready.append(batch)
        overdue = self._polls.overdue()
        if overdue is not None and self._dead is None:
            self._mark_dead(EngineDeadError(
                f"{self._who} {overdue} has not answered get_outputs within "
                f"{self._polls.answer_timeout_s:.0f} s"))

    def _teardown(self) -> None:
        for actor in [*self.ranks, self.coordinator]:
            if actor is None:
                continue
            try:
                ray.kill(actor)
            except Exception as e:  # already gone
                logger.debug("ray.kill(%s): %s", self._who, e)
        if self._owns_placement_groups:
            for slot in self.slots:
                try:
                    remove_placement_group(slot.group)
                except Exception as e:  # already removed
                    logger.debug("remove_placement_group: %s", e)


def make_ray_engine_core_client(config: EngineConfig, **kwargs: Any) -> RayEngineCoreClient:
    """What ``raylm.cluster`` calls for ``distributed_executor_backend="ray"``, any DP size."""
    return RayEngineCoreClient(config, **kwargs)


__all__ = ["RayEngineCoreClient", "make_ray_engine_core_client"]
