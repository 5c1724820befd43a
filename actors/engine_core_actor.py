"""An EngineCore in a Ray actor: one engine when data_parallel_size is 1, one DP rank of d.

With d = 1 the ordinary EngineCoreLoop steps it; with d > 1 DPEngineCoreLoop steps it in
waves over the DP Gloo group (docs/architecture.md §5). The actor is threaded so that a
long-polling ``get_outputs`` never holds up adds, aborts or ``start_wave``; only the loop
thread touches the scheduler. ``start()`` builds the executor and the engine, so its errors
(placement, bad config, model load) reach the caller with their own type.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray

from raylm.actors.actor_logging import show_raylm_info_logs
from raylm.parallel.dp_sync import DEFAULT_DP_TIMEOUT_S, DPSyncGroup
from raylm.parallel.expert_parallel import DPExpertGroup
from raylm.parallel.rendezvous import StoreRendezvous
from raylm.scheduler.config.engine_config import EngineConfig, ExecutorBackend, ParallelConfig
from raylm.scheduler.config.validation import check_rank
from raylm.scheduler.core.dp_loop import DPEngineCoreLoop
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core.engine_core_loop import EngineCoreLoop
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutputs

if TYPE_CHECKING:
    from raylm.actors.ray_executor import RayExecutor
    from raylm.runner.uniproc_executor import UniProcExecutor
    from raylm.scheduler.request import Request

logger = logging.getLogger(__name__)

# Concurrent calls the actor serves: one long poll, adds, aborts, metrics, health, waves.
ENGINE_CORE_ACTOR_CONCURRENCY = 16


def model_in_rank_actor(pc: ParallelConfig) -> bool:
    """A DP rank with TP = PP = 1 runs the model in its own actor (one process per rank,
    no dispatch hop), which then holds the rank's device. A lone engine keeps its workers
    in actors of their own, so its EngineCore and its forward hold different GILs."""
    return pc.data_parallel_size > 1 and pc.world_size == 1


def rank_config(config: EngineConfig) -> EngineConfig:
    """The config one rank's EngineCore sees: the same model and TP x PP, no DP."""
    pc = config.parallel_config
    if pc.data_parallel_size == 1:
        return config
    backend: ExecutorBackend = "uni" if model_in_rank_actor(pc) else "ray"
    return replace(config, parallel_config=replace(
        pc, data_parallel_size=1, distributed_executor_backend=backend))


def make_engine_core(config: EngineConfig, executor: Any) -> EngineCore:
    """The EngineCore over a started executor; the executor is shut down if that fails
    (its workers hold devices and placement bundles)."""
    try:
        from raylm.runner.structured.xgrammar_backend import make_structured_output_manager

        return EngineCore(config, executor, make_structured_output_manager(config))
    except BaseException:
        executor.shutdown()
        raise


# Ray's typed overload of remote() lacks max_concurrency (an actor option it takes).
@ray.remote(max_concurrency=ENGINE_CORE_ACTOR_CONCURRENCY)  # type: ignore[call-overload]
class EngineCoreActor:
    def __init__(self, config: EngineConfig, dp_rank: int = 0, coordinator: Any = None,
                 placement_group: Any = None, num_threads: int | None = None,
                 executor_kwargs: dict[str, Any] | None = None, bundle_offset: int = 1) -> None:
        """``bundle_offset``: the first of this rank's worker bundles in ``placement_group``;
        ``num_threads``: torch threads of a model run in this actor; ``coordinator``: the
        DPCoordinator (d > 1)."""
        show_raylm_info_logs()
        dp_size = config.parallel_config.data_parallel_size
        check_rank("dp_rank", dp_rank, dp_size)
        self.config = config
        self.rank_config = rank_config(config)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.coordinator = coordinator
        self.placement_group = placement_group
        self.bundle_offset = bundle_offset
        self.num_threads = num_threads
        self.executor_kwargs = dict(executor_kwargs or {})
        self.node_ip = ray.util.get_node_ip_address()
        self.engine_core: EngineCore | None = None
        self.loop: EngineCoreLoop | None = None
        self.group: DPSyncGroup | None = None
        self.ep_group: DPExpertGroup | None = None
        self._rendezvous: StoreRendezvous | None = None

    # ---- startup -----------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Build the executor and the EngineCore (model load, KV cache). With d = 1 the
        loop starts here; a DP rank's starts once it has joined the DP group."""
        from raylm.actors.ray_executor import RayExecutor

        executor = self._make_executor()
        self.engine_core = make_engine_core(self.rank_config, executor)
        if self.dp_size == 1:
            self.loop = EngineCoreLoop(self.engine_core)
        return {"dp_rank": self.dp_rank, "node_ip": self.node_ip,
                "node_id": ray.get_runtime_context().get_node_id(),
                "num_kv_blocks": self.engine_core.num_kv_blocks,
                "async_scheduling": self.engine_core.config.async_scheduling,
                "max_concurrent_batches": self.engine_core.batch_queue_size,
                "executor": type(executor).__name__,
                "worker_infos": (list(executor.worker_infos)
                                 if isinstance(executor, RayExecutor) else [])}

    def _make_executor(self) -> UniProcExecutor | RayExecutor:
        if model_in_rank_actor(self.config.parallel_config):
            from raylm.actors.gpu_assignment import current_device_assignment
            from raylm.runner.uniproc_executor import UniProcExecutor

            device = current_device_assignment(f"DP rank {self.dp_rank}")
            if self.config.parallel_config.enable_expert_parallel:
                # The experts spread over the DP ranks: this rank loads its share now and
                # dispatches through the group once the ranks have met (join_dp_group).
                self.ep_group = DPExpertGroup(self.dp_rank, self.dp_size)
            return UniProcExecutor(self.rank_config, num_threads=self.num_threads,
                                   expect_cuda=device.expect_cuda, local_rank=device.local_rank,
                                   ep_group=self.ep_group)
        from raylm.actors.ray_executor import RayExecutor

        # Experts spread over the DP ranks' workers (EP = DP x TP): each worker loads its
        # share now and joins its group across the DP ranks in join_dp_group.
        expert_dp = ((self.dp_rank, self.dp_size)
                     if self.config.parallel_config.enable_expert_parallel and self.dp_size > 1
                     else None)
        return RayExecutor(self.rank_config, placement_group=self.placement_group,
                           bundle_offset=self.bundle_offset, expert_dp=expert_dp,
                           **self.executor_kwargs)

    def publish_dp_rendezvous(self, timeout_s: float = DEFAULT_DP_TIMEOUT_S) -> tuple[str, int]:
        """Rank 0: host the DP group's store on this node; returns (host, port)."""
        if self.dp_rank != 0:
            raise ValueError(f"only DP rank 0 publishes the rendezvous, not rank {self.dp_rank}.")
        self._rendezvous = StoreRendezvous.publish(self.node_ip, self.dp_size, timeout_s)
        return self._rendezvous.host, self._rendezvous.port

    def join_dp_group(self, host: str, port: int, sync_interval: int,
                      timeout_s: float = DEFAULT_DP_TIMEOUT_S) -> None:
        """Collective over all DP ranks; then start the DP loop."""
        if self.engine_core is None:
            raise RuntimeError("EngineCoreActor.start() has not completed.")
        self.group = DPSyncGroup.join(host=host, port=port, dp_rank=self.dp_rank,
                                      dp_size=self.dp_size, timeout_s=timeout_s,
                                      local_host=self.node_ip, rendezvous=self._rendezvous)
        coordinator, rank = self.coordinator, self.dp_rank
        dummy = None
        executor = self.engine_core.executor
        if self.ep_group is not None:
            # Its own Gloo group: the forward runs on the executor's step thread, the wave
            # syncs on the loop thread.
            self.ep_group.attach(self.group.sibling_group("raylm-ep"))
            from raylm.runner.uniproc_executor import UniProcExecutor

            assert isinstance(executor, UniProcExecutor)  # model_in_rank_actor
            dummy = executor.execute_dummy_batch
        elif self.config.parallel_config.enable_expert_parallel:
            from raylm.actors.ray_executor import RayExecutor

            assert isinstance(executor, RayExecutor)  # the model runs in worker actors
            executor.join_expert_groups(host, port, timeout_s)
            dummy = executor.execute_dummy_batch
        self.loop = DPEngineCoreLoop(
            self.engine_core, dp_rank=rank, dp_size=self.dp_size,
            all_reduce=self.group.all_reduce_max, sync_interval=sync_interval,
            # Both run on the loop thread: fire and forget, never wait on the coordinator.
            request_start_wave=lambda wave: coordinator.start_wave.remote(wave, rank),
            on_wave_complete=(lambda wave: coordinator.wave_complete.remote(wave))
            if rank == 0 else None,
            # Dense models and experts inside each rank have no collective across DP ranks
            # in their forward: the dummy step is then a counted no-op. Experts spread over
            # the DP ranks: each sparse layer joins its collectives with no rows.
            execute_dummy_batch=dummy,
        )

    # ---- requests ------------------------------------------------------------------
    def _require_loop(self) -> EngineCoreLoop:
        if self.loop is None:
            raise RuntimeError(f"the EngineCore loop of rank {self.dp_rank} has not started "
                               "(start(), and join_dp_group() with d > 1).")
        return self.loop

    def _require_dp_loop(self) -> DPEngineCoreLoop:
        loop = self._require_loop()
        if not isinstance(loop, DPEngineCoreLoop):
            raise RuntimeError(f"rank {self.dp_rank} runs no DP loop (data_parallel_size=1).")
        return loop

    def add_request(self, request: Request) -> None:
        """Raises ValueError (to the caller) when the request can never be served, and
        EngineDeadError once the loop has died."""
        self._require_loop().add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._require_loop().abort_requests(request_ids)

    def start_wave(self, wave: int) -> None:
        self._require_dp_loop().start_wave(wave)

    def release_kv(self, request_ids: list[str]) -> None:
        """Prefill/decode: a decode engine holds its copy of these finished requests' KV."""
        self._require_loop().release_kv(request_ids)

    def kv_worker_handles(self) -> list[Any]:
        """The worker actors in rank order, for decode ranks that pull KV from them."""
        return self.worker_handles()

    def get_outputs(self, timeout: float) -> list[EngineCoreOutputs]:
        """Long poll: every batch ready, waiting up to ``timeout`` for the first. After the
        engine dies, the outputs queued before the death come first (the ABORT outputs of
        the requests it was serving among them), then every call raises EngineDeadError,
        a DP rank's naming the rank."""
        try:
            return self._require_loop().outputs.get_ready(timeout)
        except EngineDeadError as e:
            if self.dp_size == 1:
                raise
            raise EngineDeadError(f"DP rank {self.dp_rank}: {e}") from None

    # ---- queries -------------------------------------------------------------------
    def get_metrics(self) -> dict[str, Any]:
        loop = self._require_loop()
        metrics = dict(loop.engine_core.get_metrics())
        if isinstance(loop, DPEngineCoreLoop):
            metrics["dp"] = loop.get_dp_stats().as_dict()
        return metrics

    def get_dp_stats(self) -> dict[str, Any]:
        return self._require_dp_loop().get_dp_stats().as_dict()

    def check_health(self) -> None:
        self._require_loop().check_health()

    def worker_handles(self) -> list[Any]:
        """The worker actors, rank order (fault-injection tests, debugging); none when the
        model runs in this actor."""
        from raylm.actors.ray_executor import RayExecutor

        executor = self._require_loop().engine_core.executor
        return list(executor.workers) if isinstance(executor, RayExecutor) else []

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.shutdown()  # shuts the EngineCore down too
        elif self.engine_core is not None:
            self.engine_core.shutdown()
        self.loop = self.engine_core = None
        if self.group is not None:
            self.group.destroy()
            self.group = None
