"""RayExecutor: the Executor protocol over one Ray worker actor per TP x PP rank.

Ray does placement, lifecycle and failure detection. Steps go over the step stream
(``actors/step_channel.py``, ``dispatch="channel"``, the default) or as Ray actor calls
(``dispatch="ray"``). Both keep several steps in flight and fail every pending future with
EngineDeadError when a worker dies. Ray Compiled Graphs are not offered: slower than the
stream (``bench/dispatch.py``), seconds to compile, a fixed bound on steps in flight.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.actors import placement
from raylm.actors.step_channel import StepChannel
from raylm.actors.worker_actor import WorkerActor, new_token, output_rank
from raylm.scheduler.config import envs, openmp_wait
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import DummyBatch, ModelRunnerOutput, SchedulerOutput
from raylm.scheduler.structured.manager import GrammarOutput

if TYPE_CHECKING:
    from ray.actor import ActorClass

    from raylm.runner.worker import Worker

logger = logging.getLogger(__name__)

DISPATCH_MODES = ("channel", "ray")


def _first_lines(text: object, limit: int = 600) -> str:
    text = " ".join(line.strip() for line in str(text).splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit] + " ..."


def rank_order(infos: list[dict[str, Any]], tensor_parallel_size: int) -> list[int]:
    """The workers (as created, stage by stage) in rank order: within each stage's TP
    group, by (node, GPU id), so that TP rank i holds the group's i-th GPU."""
    def gpu_key(i: int) -> tuple:
        ids = infos[i].get("gpu_ids") or []
        return (str(infos[i].get("node_id", "")),
                tuple(int(g) if str(g).isdigit() else -1 for g in ids), i)

    tp = tensor_parallel_size
    return [i for start in range(0, len(infos), tp)
            for i in sorted(range(start, min(start + tp, len(infos))), key=gpu_key)]


@dataclass
class _StepAcks:
    """A step dispatched as Ray calls: the ranks yet to finish it, the output rank's result."""

    left: int
    result: Any = None


class RayExecutor:
    supports_async_scheduling = True

    def __init__(self, config: EngineConfig, *, placement_group: PlacementGroup | None = None,
                 bundle_offset: int = 0, resource: str | None = None,
                 cpus_per_worker: float = 1.0, dispatch: str = "channel",
                 placement_timeout_s: float | None = None,
                 init_timeout_s: float = 600.0, dist_timeout_s: float = 300.0,
                 health_timeout_s: float = 30.0,
                 worker_cls: type[Worker] | None = None,
                 expert_dp: tuple[int, int] | None = None) -> None:
        """``placement_group``: use bundles ``[bundle_offset, bundle_offset + pp)`` (one per
        pipeline stage, holding its TP group: ``stage_bundles``) of a group the caller owns (the EngineCore actor sits in an earlier bundle);
        otherwise the executor creates and owns one. ``worker_cls`` replaces
        ``raylm.runner.worker.Worker`` (tests, benchmarks). ``expert_dp``: (DP rank, DP
        size) of this engine when the experts spread over the DP ranks' workers too."""
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}.")
        pc = config.parallel_config
        self.config = config
        self.world_size = pc.world_size
        self.output_rank = output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self.dispatch = dispatch
        self.health_timeout_s = health_timeout_s
        self.workers: list[Any] = []
        self.worker_infos: list[dict[str, Any]] = []
        self._dead_error: EngineDeadError | None = None
        self._dead_lock = threading.Lock()
        self._channel: StepChannel | None = None
        self._serving = False  # the workers' torch threads run the stream (first step on)
        self._seq = 0
        self._owns_pg = placement_group is None
        self.expert_dp = expert_dp
        placement.ensure_ray_initialized(self.world_size * cpus_per_worker)
        try:
            self._init_placement(placement_group, bundle_offset, resource, cpus_per_worker,
                                 pc.placement_group_strategy,
                                 placement_timeout_s or pc.placement_timeout_s)
            self._init_workers(worker_cls, init_timeout_s, dist_timeout_s)
            if dispatch == "channel":
                self._init_channel(init_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- setup -------------------------------------------------------------------------

    def _init_placement(self, pg, bundle_offset, resource, cpus_per_worker, strategy,
                        timeout_s) -> None:
        tp = self.config.parallel_config.tensor_parallel_size
        pp = self.config.parallel_config.pipeline_parallel_size
        if pg is None:
            bundles = placement.worker_bundles(
                tp, pp, resource or placement.default_worker_resource(), cpus_per_worker)
            pg = placement.create_placement_group(bundles, strategy, timeout_s)
            bundle_offset = 0
        if bundle_offset + pp > len(pg.bundle_specs):
            raise ValueError(f"placement group has {len(pg.bundle_specs)} bundles, need one per "
                             f"pipeline stage ({pp}) from bundle_offset={bundle_offset}.")
        self.placement_group = pg
        self.bundle_offset = bundle_offset

    def _init_workers(self, worker_cls, init_timeout_s, dist_timeout_s) -> None:
        ifname = envs.gloo_socket_ifname()
        env = {"GLOO_SOCKET_IFNAME": ifname} if ifname else {}
        env.update(envs.forwarded_to_actors())
        # Read by the actor's libgomp when it loads torch: at process start, not in a call.
        wait_env = openmp_wait.to_forward()
        tp = self.config.parallel_config.tensor_parallel_size
        for rank in range(self.world_size):
            # A stage's TP group shares its bundle (one node); each takes its share of it.
            bundle_index = self.bundle_offset + rank // tp
            cpus, gpus = placement.rank_resources(
                self.placement_group.bundle_specs[bundle_index], tp)
            # Torch intra-op threads follow the rank's CPU share of its bundle.
            threads = placement.threads_for_cpus(cpus)
            # mypy leaves class decorators out: the class is what @ray.remote made of it.
            actor_cls = cast("ActorClass[WorkerActor]", WorkerActor)
            self.workers.append(actor_cls.options(
                num_cpus=cpus, num_gpus=gpus, name=None,
                runtime_env={"env_vars": wait_env} if wait_env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=bundle_index),
            ).remote(rank, threads, env))
        infos = self._get([w.get_node_info.remote() for w in self.workers],
                          init_timeout_s, "starting the worker actors")
        order = rank_order(infos, tp)
        self.workers = [self.workers[i] for i in order]
        self.worker_infos = [infos[i] for i in order]
        self._get([w.assign_rank.remote(rank) for rank, w in enumerate(self.workers)],
                  init_timeout_s, "numbering the ranks")
        init_method = None
        if self.world_size > 1:
            init_method = self._get(
                [self.workers[0].publish_rendezvous.remote(self.world_size, dist_timeout_s)],
                init_timeout_s, "publishing the rendezvous")[0]
        self._get([w.init_worker.remote(self.config, init_method, 0, worker_cls, dist_timeout_s,
                                        self.expert_dp)
                   for w in self.workers], dist_timeout_s + 60, "joining torch.distributed")
        devices = self._get([w.load_model.remote() for w in self.workers], init_timeout_s,
                            "loading the model")
        for info, device in zip(self.worker_infos, devices, strict=True):
            info["device"] = device

    def _init_channel(self, timeout_s: float) -> None:
        token = new_token()
        addresses = self._get([w.open_step_server.remote(token) for w in self.workers],
                              timeout_s, "opening the step streams")
        self._channel = StepChannel(addresses, token, self.output_rank, self._on_worker_failure)

    def _start_serving(self) -> None:
        """Hand each worker's torch thread to its stream. From here until the stream closes
        that thread runs steps only, so the setup calls (which run on it too) must be done."""
        self._serving = True
        for w in self.workers:  # returns when its stream closes; failures travel on the stream
            w.serve_steps.remote()

    def _check_setup_allowed(self, what: str) -> None:
        if self._serving:
            raise RuntimeError(f"{what} must come before the first step: the workers' torch "
                               "threads are serving the step stream.")

    def _get(self, refs: list, timeout_s: float, what: str) -> list:
        return placement.get_within(refs, timeout_s, what, on=f"{self.world_size} worker actors")

    def describe_worker(self, rank: int) -> str:
        info = self.worker_infos[rank] if rank < len(self.worker_infos) else {}
        actor_id = str(info.get("actor_id", "?"))[:12]
        return (f"worker rank {rank} (actor {actor_id}, pid {info.get('pid', '?')}, "
                f"node {info.get('node_ip', '?')})")

    # ---- failures ----------------------------------------------------------------------------

    def _on_worker_failure(self, rank: int, reason: str, probe: bool = True) -> EngineDeadError:
        """Record the first failure (logged once) and return the error for every waiter."""
        with self._dead_lock:
            if self._dead_error is not None:
                return self._dead_error
        cause = self._probe_actor(rank) if probe else None
        with self._dead_lock:
            if self._dead_error is None:
                self._dead_error = EngineDeadError(
                    f"{self.describe_worker(rank)} failed: {reason}"
                    + (f"; Ray reports: {cause}" if cause else ""))
                logger.error("Engine is dead: %s", self._dead_error)
            return self._dead_error

    def _probe_actor(self, rank: int) -> str | None:
        """Ask Ray why a worker's stream closed (it knows whether the actor died and why)."""
        try:
            ray.get(self.workers[rank].get_node_info.remote(), timeout=5)
        except ray.exceptions.GetTimeoutError:
            return "the actor does not answer"
        except ray.exceptions.RayError as e:
            return _first_lines(e)
        return None

    def _on_ray_step_done(self, rank: int, step: Future, acks: _StepAcks,
                          ref_future: Future) -> None:
        """A step is done once every rank finished it (the output rank's result is held
        until then): a rank that died before finishing it fails it, even where the output
        rank returned first (a stand-in worker that shares no collective may)."""
        error = ref_future.exception()
        try:
            if error is not None:
                step.set_exception(self._on_worker_failure(rank, _first_lines(error), probe=False))
                return
            with self._dead_lock:
                if rank == self.output_rank:
                    acks.result = ref_future.result()
                acks.left -= 1
                done = acks.left == 0
            if done:
                step.set_result(acks.result)
        except InvalidStateError:
            pass  # another rank already failed this step

    # ---- Executor protocol ----------------------------------------------------------------------

    def determine_num_kv_blocks(self) -> int:
        self._check_setup_allowed("determine_num_kv_blocks")
        return min(self._get([w.determine_num_kv_blocks.remote() for w in self.workers],
                             self.health_timeout_s, "measuring the KV cache"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._check_setup_allowed("initialize_kv_cache")
        self._get([w.initialize_kv_cache.remote(num_blocks) for w in self.workers],
                  self.health_timeout_s * 4, "allocating the KV cache")

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        return self._submit(scheduler_output, non_block)

    def sample_tokens(self, grammar_output: GrammarOutput, non_block: bool = False
                      ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Travels the step stream like a step (every rank gets it; the last stage
        samples), so it stays ordered behind the step it samples."""
        return self._submit(grammar_output, non_block)

    def _submit(self, message: SchedulerOutput | GrammarOutput | DummyBatch, non_block: bool
                ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        if self._dead_error is not None:
            raise self._dead_error
        if self._channel is not None:
            if not self._serving:
                self._start_serving()
            future = self._channel.submit(message)
        else:
            future = Future()
            seq, self._seq = self._seq, self._seq + 1
            acks = _StepAcks(left=len(self.workers))
            for rank, worker in enumerate(self.workers):
                ref = worker.execute_model.remote(seq, message)
                ref.future().add_done_callback(
                    functools.partial(self._on_ray_step_done, rank, future, acks))
        return future if non_block else future.result()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        """Call a public Worker method on every rank; results in rank order."""
        refs = [w.call.remote(method, *args, **(kwargs or {})) for w in self.workers]
        return self._get(refs, timeout_s or self.health_timeout_s, f"collective_rpc({method!r})")

    def join_expert_groups(self, host: str, port: int, timeout_s: float) -> None:
        """Collective with the other DP ranks' executors: each worker joins the Gloo group
        of its (stage, TP rank) across the DP ranks, on DP rank 0's store."""
        self._get([w.join_expert_group.remote(host, port, timeout_s) for w in self.workers],
                  timeout_s + 30, "joining the expert-parallel groups")

    def execute_dummy_batch(self) -> None:
        """A wave step without a forward of this DP rank's own: every worker runs its
        stage's sparse layers' collectives with no rows, in order behind the steps sent
        before it; returns once every worker has."""
        self._submit(DummyBatch(), non_block=False)

    def expert_load(self) -> dict[int, dict[int, int]]:
        """Every rank's layers and experts merged: a stage's TP ranks report the same
        experts (TP inside the experts) or disjoint ones (expert parallelism)."""
        merged: dict[int, dict[int, int]] = {}
        for rank_load in self.collective_rpc("expert_load"):
            for layer, experts in rank_load.items():
                merged.setdefault(layer, {}).update(experts)
        return merged

    def device_info(self) -> dict[str, Any]:
        device = self.worker_infos[0].get("device") or {"kind": "unknown", "name": "unknown"}
        return {**device, "count": self.world_size}

    def check_health(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        refs = [w.check_health.remote() for w in self.workers]
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=self.health_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise self._on_worker_failure(
                    rank, f"no health answer within {self.health_timeout_s:g}s") from None
            except ray.exceptions.RayError as e:
                raise self._on_worker_failure(rank, _first_lines(e), probe=False) from e

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.workers and self._dead_error is None:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
            except ray.exceptions.RayError as e:
                logger.warning("Worker shutdown did not complete: %s", _first_lines(e))
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._owns_pg and getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
