"""RayEngineCoreClient: the EngineCoreClient protocol over an EngineCoreActor.

Same synchronous API as ``InprocEngineCoreClient``. The client owns one placement group:
bundle 0 (``{"CPU": 1}``) holds the EngineCore actor, bundles 1..world_size hold the
workers, so under PACK the EngineCore sits next to rank 0. A driver-side thread long-polls
the actor for outputs and queues them; a dead actor or engine becomes one
EngineDeadError that every later ``get_output`` raises.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import get_current_placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.actors.engine_core_actor import EngineCoreActor
from raylm.actors.placement import (
    create_placement_group,
    default_worker_resource,
    ensure_ray_initialized,
    worker_bundles,
)
from raylm.actors.remote_engine import RemoteEngineCalls, as_engine_dead, submit
from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.engine_core_loop import next_output
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutputs

if TYPE_CHECKING:
    from raylm.scheduler.request import Request

logger = logging.getLogger(__name__)


class RayEngineCoreClient(RemoteEngineCalls):
    def __init__(self, config: EngineConfig, *, resource: str | None = None,
                 cpus_per_worker: float = 1.0, engine_core_cpus: float = 1.0,
                 placement_timeout_s: float | None = None,
                 init_timeout_s: float = 600.0, poll_timeout_s: float = 0.5,
                 call_timeout_s: float = 60.0, **executor_kwargs: Any) -> None:
        """``executor_kwargs`` go to RayExecutor (``dispatch``, ``worker_cls``, timeouts)."""
        pc = config.parallel_config
        ensure_ray_initialized(engine_core_cpus + pc.world_size * cpus_per_worker)
        self.config = config
        self.poll_timeout_s = poll_timeout_s
        self.call_timeout_s = call_timeout_s
        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= 1 + pc.pipeline_parallel_size:
            # Inside a Serve replica whose deployment reserved [replica, stage 0..P-1]: reuse
            # those bundles (reserving a second group would hold every CPU/GPU twice). The
            # EngineCore actor shares bundle 0 with the replica.
            self.placement_group, self._owns_placement_group = current, False
            engine_core_cpus = 0.0
        else:
            bundles = [{"CPU": float(engine_core_cpus)}] + worker_bundles(
                pc.tensor_parallel_size, pc.pipeline_parallel_size,
                resource or default_worker_resource(), cpus_per_worker)
            self.placement_group = create_placement_group(
                bundles, pc.placement_group_strategy,
                placement_timeout_s or pc.placement_timeout_s)
            self._owns_placement_group = True
        env = envs.forwarded_to_actors()
        self.actor = EngineCoreActor.options(
            num_cpus=engine_core_cpus,
            runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=0),
        ).remote(config, self.placement_group, 1, executor_kwargs)
        try:
            self.info = ray.get(self.actor.start.remote(), timeout=init_timeout_s)
        except BaseException:
            self._teardown()
            raise
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self._stopped = threading.Event()
        self._init_death_tracking()
        self._poller = threading.Thread(target=self._poll, name="raylm-engine-core-poll",
                                        daemon=True)
        self._poller.start()

    # ---- EngineCoreClient protocol --------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Raises ValueError when the request can never be served, EngineDeadError if dead."""
        self._check_not_dead()
        self._call(submit(self.actor.add_request, request), "add_request")

    def abort_requests(self, request_ids: list[str]) -> None:
        self._check_not_dead()
        self._call(submit(self.actor.abort_requests, list(request_ids)), "abort_requests")

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        return next_output(self._outputs, timeout)

    def get_metrics(self) -> dict[str, Any]:
        return self._call(submit(self.actor.get_metrics), "get_metrics")

    def check_health(self) -> None:
        self._check_not_dead()
        self._call(submit(self.actor.check_health), "check_health")

    def shutdown(self) -> None:
        """Idempotent; after Ray itself has shut down (interpreter exit) there is nothing
        left to release."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        if getattr(self, "_stopped", None) is not None:
            self._stopped.set()
            self._poller.join(timeout=self.poll_timeout_s + 10)
        if not ray.is_initialized():
            return
        if self._dead is None:
            try:
                ray.get(self.actor.shutdown.remote(), timeout=self.call_timeout_s)
            except ray.exceptions.RayError as e:
                logger.warning("EngineCore actor shutdown did not complete: %s", e)
        self._teardown()

    # ---- internals ---------------------------------------------------------------------------

    def _poll(self) -> None:
        ref = None
        while not self._stopped.is_set():
            try:
                ref = self.actor.get_outputs.remote(self.poll_timeout_s)
                batches = ray.get(ref, timeout=self.poll_timeout_s + self.call_timeout_s)
            except ray.exceptions.RayError as e:
                if not self._stopped.is_set():
                    self._mark_dead(as_engine_dead(e, self._who, "get_outputs"))
                return
            for batch in batches:
                self._outputs.put(batch)

    def _teardown(self) -> None:
        try:
            ray.kill(self.actor)
        except Exception as e:  # already gone
            logger.debug("ray.kill(EngineCore actor): %s", e)
        if self._owns_placement_group:
            try:
                remove_placement_group(self.placement_group)
            except Exception as e:  # already removed
                logger.debug("remove_placement_group: %s", e)


def make_ray_engine_core_client(config: EngineConfig, **kwargs: Any) -> RayEngineCoreClient:
    """What ``raylm.cluster`` calls for ``distributed_executor_backend="ray"``."""
    return RayEngineCoreClient(config, **kwargs)
