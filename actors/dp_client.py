"""DPEngineCoreClient: the EngineCoreClient protocol over d DP rank actors.

Each rank is a DPEngineCoreActor (own EngineCore, scheduler, KV cache, workers) in its own
placement group, or, inside a Serve replica whose deployment reserved them, in its slice of
the replica's group (``[replica] + d x [rank bundles]``); a DPCoordinator actor starts
waves on all ranks; a DPLoadBalancer here routes every new request to the rank with the
fewest unfinished requests. One driver-side thread per rank long-polls that rank's
outputs; ``get_output`` merges what is ready from all ranks (per rank, order is kept). A
dead rank, or one a peer's DP all-reduce found dead, becomes one EngineDeadError that every
later ``get_output`` raises.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import get_current_placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.actors.dp_coordinator import DPCoordinator, DPLoadBalancer
from raylm.actors.dp_engine_core_actor import DPEngineCoreActor
from raylm.actors.placement import (
    create_placement_group,
    default_worker_resource,
    ensure_ray_initialized,
    get_within,
    threads_for_cpus,
    worker_bundle,
)
from raylm.actors.remote_engine import RemoteEngineCalls, as_engine_dead, submit
from raylm.parallel.dp_sync import DEFAULT_DP_TIMEOUT_S
from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import EngineConfig, dp_rank_bundles
from raylm.scheduler.core.engine_core_loop import next_output
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutputs, SchedulerStats

if TYPE_CHECKING:
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
    for key, value in per_rank[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total = sum(m.get(key, 0) for m in per_rank)
            merged[key] = total / len(per_rank) if key in _AVERAGED else total
    merged["dp_ranks"] = per_rank
    return merged


class DPEngineCoreClient(RemoteEngineCalls):
    _who = "DP rank actor"
    def __init__(self, config: EngineConfig, *, resource: str | None = None,
                 cpus_per_rank: float = 1.0, cpus_per_worker: float = 1.0,
                 placement_timeout_s: float | None = None,
                 init_timeout_s: float = 600.0, poll_timeout_s: float = 0.5,
                 call_timeout_s: float = 60.0, dp_sync_timeout_s: float = DEFAULT_DP_TIMEOUT_S,
                 **executor_kwargs: Any) -> None:
        """``executor_kwargs`` go to each rank's RayExecutor (TP x PP > 1 only)."""
        pc = config.parallel_config
        if pc.distributed_executor_backend != "ray":
            raise ValueError(f"distributed_executor_backend must be 'ray' for data parallelism, "
                             f"got {pc.distributed_executor_backend!r}.")
        ensure_ray_initialized()
        self.config = config
        self.dp_size = pc.data_parallel_size
        self.poll_timeout_s = poll_timeout_s
        self.call_timeout_s = call_timeout_s
        self.balancer = DPLoadBalancer(self.dp_size)
        self.placement_groups: list[Any] = []  # rank r's group (the same one for all in Serve)
        self.bundle_bases: list[int] = []  # rank r's first bundle in its group
        self._owns_placement_groups = True
        self.ranks: list[Any] = []
        self.coordinator: Any = None
        self._outputs: queue.Queue[tuple[int, EngineCoreOutputs] | EngineDeadError] = queue.Queue()
        self._latest_stats: dict[int, SchedulerStats] = {}
        self._stopped = threading.Event()
        self._init_death_tracking()
        self._pollers: list[threading.Thread] = []
        try:
            self._init_placement(resource or default_worker_resource(), cpus_per_rank,
                                 cpus_per_worker,
                                 placement_timeout_s or pc.placement_timeout_s)
            self._init_ranks(cpus_per_rank, executor_kwargs, init_timeout_s)
            self._init_dp_group(pc.dp_sync_interval, dp_sync_timeout_s)
        except BaseException:
            self._teardown()
            raise
        self._init_pollers()

    # ---- startup ---------------------------------------------------------------------
    def _init_placement(self, resource: str, cpus_per_rank: float, cpus_per_worker: float,
                        timeout_s: float) -> None:
        pc = self.config.parallel_config
        ws, tp, pp = pc.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size
        per_rank = len(dp_rank_bundles(tp, pp, {}, {}))
        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= 1 + self.dp_size * per_rank:
            # Inside a Serve replica whose deployment reserved [replica] + d x [rank]:
            # reserving d more groups would hold every CPU/GPU twice.
            self.placement_groups = [current] * self.dp_size
            self.bundle_bases = [1 + rank * per_rank for rank in range(self.dp_size)]
            self._owns_placement_groups = False
            return
        # With TP = PP = 1 the rank actor runs the model: its bundle is the device.
        worker = worker_bundle(resource, cpus_per_rank if ws == 1 else cpus_per_worker)
        bundles = dp_rank_bundles(tp, pp, {"CPU": float(cpus_per_rank)}, worker)
        strategy = self.config.parallel_config.placement_group_strategy
        self.bundle_bases = [0] * self.dp_size
        for rank in range(self.dp_size):
            self.placement_groups.append(create_placement_group(
                bundles, strategy, timeout_s, name=None))
            logger.info("DP rank %d placement group: %s", rank, bundles)

    def _init_ranks(self, cpus_per_rank: float, executor_kwargs: dict[str, Any],
                    timeout_s: float) -> None:
        self.coordinator = DPCoordinator.remote(self.dp_size)
        for rank, (pg, base) in enumerate(zip(self.placement_groups, self.bundle_bases)):
            bundle = pg.bundle_specs[base]
            cpus, gpus = bundle.get("CPU", 0.0), bundle.get("GPU", 0.0)
            threads = threads_for_cpus(cpus or cpus_per_rank)
            env = envs.forwarded_to_actors()
            self.ranks.append(DPEngineCoreActor.options(
                num_cpus=cpus, num_gpus=gpus, runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=base),
            ).remote(self.config, rank, self.coordinator, pg, threads, executor_kwargs,
                     bundle_offset=base + 1))
        ray.get(self.coordinator.register_ranks.remote(self.ranks), timeout=timeout_s)
        self.rank_infos = self._get([r.start.remote() for r in self.ranks], timeout_s,
                                    "starting the DP rank EngineCores")

    def _init_dp_group(self, sync_interval: int, timeout_s: float) -> None:
        host, port = self._get([self.ranks[0].publish_dp_rendezvous.remote(timeout_s)],
                               self.call_timeout_s, "publishing the DP rendezvous")[0]
        self._get([r.join_dp_group.remote(host, port, sync_interval, timeout_s)
                   for r in self.ranks], timeout_s + 30, "joining the DP Gloo group")

    def _init_pollers(self) -> None:
        for rank in range(self.dp_size):
            t = threading.Thread(target=self._poll, args=(rank,), daemon=True,
                                 name=f"raylm-dp{rank}-poll")
            t.start()
            self._pollers.append(t)

    def _get(self, refs: list, timeout_s: float, what: str) -> list:
        return get_within(refs, timeout_s, what, on=f"{self.dp_size} DP rank actors")

    # ---- EngineCoreClient protocol -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        """To the least-loaded rank. Raises ValueError when the request can never be
        served, EngineDeadError if the engine is dead."""
        self._check_not_dead()
        rank = self.balancer.select(request.request_id)
        try:
            # Synchronous: the rank's ValueError reaches the caller, and a later abort
            # cannot overtake the add on the (threaded, so unordered) actor.
            self._call(submit(self.ranks[rank].add_request, request), "add_request")
        except BaseException:
            self.balancer.finish(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        """To each request's rank; ids already finished are dropped here (no output)."""
        self._check_not_dead()
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.balancer.owner(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        refs = [submit(self.ranks[rank].abort_requests, ids) for rank, ids in by_rank.items()]
        if refs:
            self._call(refs, "abort_requests")

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """What is ready from every rank, merged (each rank's outputs in its order)."""
        item = next_output(self._outputs, timeout)
        if item is None:
            return None
        merged = EngineCoreOutputs()
        has_stats = False
        while item is not None:
            _, batch = item
            merged.outputs.extend(batch.outputs)
            has_stats = has_stats or batch.scheduler_stats is not None
            try:
                item = next_output(self._outputs, 0)
            except EngineDeadError:
                break  # deliver what came before the death first; it stays queued
        if has_stats:
            merged.scheduler_stats = merge_scheduler_stats(list(dict(self._latest_stats).values()))
        return merged

    def get_metrics(self) -> dict[str, Any]:
        per_rank = self._call([submit(r.get_metrics) for r in self.ranks], "get_metrics")
        merged = merge_metrics(per_rank)
        merged["raylm:dp_num_waves"] = per_rank[0]["dp"]["num_waves_completed"]
        merged["dp_unfinished_requests"] = self.balancer.num_unfinished()
        merged["dp_routed_requests"] = self.balancer.num_routed()
        return merged

    def get_dp_state(self) -> dict[str, Any]:
        """Waves and routing: per-rank loop stats, the coordinator's view, the balancer's."""
        return {"ranks": self._call([r.get_dp_stats.remote() for r in self.ranks], "get_dp_stats"),
                "coordinator": self._call(self.coordinator.get_state.remote(), "get_state"),
                "unfinished": self.balancer.num_unfinished(),
                "routed": self.balancer.num_routed()}

    def check_health(self) -> None:
        self._check_not_dead()
        self._call([submit(r.check_health) for r in self.ranks], "check_health")

    def shutdown(self) -> None:
        """Idempotent; after Ray itself has shut down (interpreter exit) there is nothing
        left to release."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for t in self._pollers:
            t.join(timeout=self.poll_timeout_s + 10)
        if not ray.is_initialized():
            return
        if self._dead is None and self.ranks:
            # Concurrently: a running rank leaves at its wave's next collective, which
            # needs every peer to reach it.
            try:
                ray.get([r.shutdown.remote() for r in self.ranks], timeout=self.call_timeout_s)
            except ray.exceptions.RayError as e:
                logger.warning("DP rank shutdown did not complete: %s", e)
        self._teardown()

    # ---- internals -----------------------------------------------------------------------
    def _poll(self, rank: int) -> None:
        actor = self.ranks[rank]
        while not self._stopped.is_set():
            try:
                batches = ray.get(actor.get_outputs.remote(self.poll_timeout_s),
                                  timeout=self.poll_timeout_s + self.call_timeout_s)
            except ray.exceptions.RayError as e:
                if not self._stopped.is_set():
                    self._mark_dead(as_engine_dead(e, self._who, f"get_outputs of DP rank {rank}"))
                return
            for batch in batches:
                for out in batch.outputs:
                    if out.finished:
                        self.balancer.finish(out.request_id)
                if batch.scheduler_stats is not None:
                    self._latest_stats[rank] = batch.scheduler_stats
                self._outputs.put((rank, batch))

    def _teardown(self) -> None:
        for actor in [*self.ranks, self.coordinator]:
            if actor is None:
                continue
            try:
                ray.kill(actor)
            except Exception as e:  # already gone
                logger.debug("ray.kill(DP actor): %s", e)
        if self._owns_placement_groups:
            for pg in self.placement_groups:
                try:
                    remove_placement_group(pg)
                except Exception as e:  # already removed
                    logger.debug("remove_placement_group: %s", e)


def make_dp_engine_core_client(config: EngineConfig, **kwargs: Any) -> DPEngineCoreClient:
    """What ``raylm.cluster`` calls when ``data_parallel_size > 1``."""
    return DPEngineCoreClient(config, **kwargs)


__all__ = ["DPEngineCoreClient", "make_dp_engine_core_client"]
