"""One DP rank: an EngineCore (own scheduler, KV cache, workers) in a Ray actor, stepped by
DPEngineCoreLoop over the DP Gloo group.

Rank placement (docs/architecture.md §5): with TP = PP = 1 the rank's model runs inside this actor
(``UniProcExecutor``): no worker actor, no per-step dispatch hop, one process per rank;
the actor then holds the rank's device (its bundle is ``{"GPU": 1}`` or ``{"CPU": n}``).
With TP x PP > 1 the rank gets its own ``RayExecutor``: worker actors in the rank's own
placement group (bundle 0 is this actor, bundles 1.. the workers; offset by the rank's
slice when the ranks share a Serve replica's group), and its own
torch.distributed world; the DP group is a separate stateless Gloo group, so the two
never collide.

Startup, driven by the client: ``start()`` on every rank, ``publish_dp_rendezvous()`` on
rank 0, ``join_dp_group(host, port)`` on every rank concurrently (a collective), which
also starts the loop. The DP all-reduce runs on the loop thread; the actor is threaded so
a long-polling ``get_outputs`` does not hold up adds, aborts or start_wave.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray

from raylm.actors.engine_core_actor import make_engine_core, poll_outputs
from raylm.parallel.dp_sync import DEFAULT_DP_TIMEOUT_S, DPSyncGroup
from raylm.parallel.rendezvous import StoreRendezvous
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.config.validation import check_rank
from raylm.scheduler.core.dp_loop import DPEngineCoreLoop
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutputs

if TYPE_CHECKING:
    from raylm.scheduler.request import Request

logger = logging.getLogger(__name__)

DP_ACTOR_CONCURRENCY = 16


def dp_rank_config(config: EngineConfig) -> EngineConfig:
    """The config one rank's EngineCore sees: the same model and per-rank TP x PP, no DP."""
    pc = config.parallel_config
    backend = "uni" if pc.world_size == 1 else "ray"
    return replace(config, parallel_config=replace(
        pc, data_parallel_size=1, distributed_executor_backend=backend))


@ray.remote(max_concurrency=DP_ACTOR_CONCURRENCY)
class DPEngineCoreActor:
    def __init__(self, config: EngineConfig, dp_rank: int, coordinator: Any,
                 placement_group: Any = None, num_threads: int | None = None,
                 executor_kwargs: dict[str, Any] | None = None, bundle_offset: int = 1) -> None:
        """``bundle_offset``: the first of this rank's worker bundles in ``placement_group``
        (TP x PP > 1)."""
        dp_size = config.parallel_config.data_parallel_size
        check_rank("dp_rank", dp_rank, dp_size)
        self.config = config
        self.rank_config = dp_rank_config(config)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.coordinator = coordinator
        self.placement_group = placement_group
        self.bundle_offset = bundle_offset
        self.num_threads = num_threads
        self.executor_kwargs = dict(executor_kwargs or {})
        self.node_ip = ray.util.get_node_ip_address()
        self.engine_core: EngineCore | None = None
        self.loop: DPEngineCoreLoop | None = None
        self.group: DPSyncGroup | None = None
        self._rendezvous: StoreRendezvous | None = None

    # ---- startup -----------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Build the rank's executor and EngineCore (model load, KV cache)."""
        executor = self._make_executor()
        self.engine_core = make_engine_core(self.rank_config, executor)
        return {"dp_rank": self.dp_rank, "node_ip": self.node_ip,
                "node_id": ray.get_runtime_context().get_node_id(),
                "num_kv_blocks": self.engine_core.num_kv_blocks,
                "async_scheduling": self.engine_core.config.async_scheduling,
                "executor": type(executor).__name__}

    def _make_executor(self) -> Any:
        if self.rank_config.parallel_config.world_size == 1:
            from raylm.actors.gpu_assignment import current_device_assignment
            from raylm.runner.uniproc_executor import UniProcExecutor

            device = current_device_assignment(f"DP rank {self.dp_rank}")
            return UniProcExecutor(self.rank_config, num_threads=self.num_threads,
                                   expect_cuda=device.expect_cuda, local_rank=device.local_rank)
        from raylm.actors.ray_executor import RayExecutor

        return RayExecutor(self.rank_config, placement_group=self.placement_group,
                           bundle_offset=self.bundle_offset, **self.executor_kwargs)

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
            raise RuntimeError("DPEngineCoreActor.start() has not completed.")
        self.group = DPSyncGroup.join(host=host, port=port, dp_rank=self.dp_rank,
                                      dp_size=self.dp_size, timeout_s=timeout_s,
                                      local_host=self.node_ip, rendezvous=self._rendezvous)
        coordinator, rank = self.coordinator, self.dp_rank
        self.loop = DPEngineCoreLoop(
            self.engine_core, dp_rank=rank, dp_size=self.dp_size,
            all_reduce=self.group.all_reduce_max, sync_interval=sync_interval,
            # Both run on the loop thread: fire and forget, never wait on the coordinator.
            request_start_wave=lambda wave: coordinator.start_wave.remote(wave, rank),
            on_wave_complete=(lambda wave: coordinator.wave_complete.remote(wave))
            if rank == 0 else None,
            # Dense models have no collective across DP ranks in their forward: the
            # dummy step is a counted no-op (an MoE/EP model would run a dummy forward).
            execute_dummy_batch=None,
        )

    # ---- requests ------------------------------------------------------------------
    def _require_loop(self) -> DPEngineCoreLoop:
        if self.loop is None:
            raise RuntimeError("DPEngineCoreActor.join_dp_group() has not completed.")
        return self.loop

    def add_request(self, request: Request) -> None:
        """Raises ValueError (to the caller) when the request can never be served."""
        self._require_loop().add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._require_loop().abort_requests(request_ids)

    def start_wave(self, wave: int) -> None:
        self._require_loop().start_wave(wave)

    def get_outputs(self, timeout: float) -> list[EngineCoreOutputs]:
        """engine_core_actor.poll_outputs, with the rank named in the death."""
        try:
            return poll_outputs(self._require_loop(), timeout)
        except EngineDeadError as e:
            raise EngineDeadError(f"DP rank {self.dp_rank}: {e}") from None

    # ---- queries -------------------------------------------------------------------
    def get_metrics(self) -> dict[str, Any]:
        loop = self._require_loop()
        metrics = dict(loop.engine_core.get_metrics())
        metrics["dp"] = loop.get_dp_stats().as_dict()
        return metrics

    def get_dp_stats(self) -> dict[str, Any]:
        return self._require_loop().get_dp_stats().as_dict()

    def check_health(self) -> None:
        self._require_loop().check_health()

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.shutdown()
            self.loop = None
        elif self.engine_core is not None:
            self.engine_core.shutdown()
        if self.group is not None:
            self.group.destroy()
