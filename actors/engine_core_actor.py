"""The EngineCore in a Ray actor: EngineCoreLoop around EngineCore(config, RayExecutor).

The actor is threaded: a long-polling ``get_outputs`` must not hold up ``add_request`` or
``abort_requests``. The loop thread is still the only one that touches the scheduler.
Construction is cheap; ``start()`` builds the executor and the engine so that its errors
(placement, bad config, model load) reach the caller with their own type.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ray

from raylm.actors.ray_executor import RayExecutor
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core.engine_core_loop import EngineCoreLoop
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutputs

if TYPE_CHECKING:
    from raylm.scheduler.request import Request

logger = logging.getLogger(__name__)

# Concurrent calls the actor serves: one long poll, adds, aborts, metrics, health.
ENGINE_CORE_ACTOR_CONCURRENCY = 16


def poll_outputs(loop: EngineCoreLoop, timeout: float) -> list[EngineCoreOutputs]:
    """Long poll: wait up to ``timeout`` for the first batch, then take what is ready.

    After the engine dies, the ABORT outputs of the requests it was serving come once (the
    loop queues them before the error), then every call raises EngineDeadError.
    """
    batches: list[EngineCoreOutputs] = []
    wait: float | None = timeout
    while True:
        try:
            batch = loop.get_output(timeout=wait)
        except EngineDeadError:
            if batches:
                return batches  # deliver what came before the death first
            raise
        if batch is None:
            return batches
        batches.append(batch)
        wait = 0.0


def make_engine_core(config: EngineConfig, executor: Any) -> EngineCore:
    """The EngineCore over a started executor; the executor is shut down if that fails
    (its workers hold devices and placement bundles)."""
    try:
        from raylm.runner.structured.xgrammar_backend import make_structured_output_manager

        return EngineCore(config, executor, make_structured_output_manager(config))
    except BaseException:
        executor.shutdown()
        raise


@ray.remote(max_concurrency=ENGINE_CORE_ACTOR_CONCURRENCY)
class EngineCoreActor:
    def __init__(self, config: EngineConfig, placement_group: Any = None,
                 bundle_offset: int = 1, executor_kwargs: dict[str, Any] | None = None) -> None:
        self.config = config
        self.placement_group = placement_group
        self.bundle_offset = bundle_offset
        self.executor_kwargs = dict(executor_kwargs or {})
        self.engine_core: EngineCore | None = None
        self.loop: EngineCoreLoop | None = None

    def start(self) -> dict[str, Any]:
        """Start the workers (in the caller's placement group, if any) and the loop."""
        executor = RayExecutor(self.config, placement_group=self.placement_group,
                               bundle_offset=self.bundle_offset, **self.executor_kwargs)
        self.engine_core = make_engine_core(self.config, executor)
        self.loop = EngineCoreLoop(self.engine_core)
        return {"num_kv_blocks": self.engine_core.num_kv_blocks,
                "async_scheduling": self.engine_core.config.async_scheduling,
                "max_concurrent_batches": self.engine_core.batch_queue_size,
                "worker_infos": executor.worker_infos}

    def _require_loop(self) -> EngineCoreLoop:
        if self.loop is None:
            raise RuntimeError("EngineCoreActor.start() has not completed.")
        return self.loop

    def add_request(self, request: Request) -> None:
        """Raises ValueError (to the caller) when the request can never be served."""
        loop = self._require_loop()
        if loop.dead_error is not None:
            raise EngineDeadError(f"EngineCore died: {loop.dead_error!r}")
        loop.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._require_loop().abort_requests(request_ids)

    def get_outputs(self, timeout: float) -> list[EngineCoreOutputs]:
        return poll_outputs(self._require_loop(), timeout)

    def get_metrics(self) -> dict[str, Any]:
        return self._require_loop().engine_core.get_metrics()

    def check_health(self) -> None:
        self._require_loop().check_health()

    def worker_handles(self) -> list[Any]:
        """The worker actors, rank order (fault-injection tests, debugging)."""
        return list(self._require_loop().engine_core.executor.workers)

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.shutdown()
            self.loop = None
