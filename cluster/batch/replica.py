"""One ``raylm batch`` replica: a Ray Data actor that owns one raylm engine.

Ray Data's actor pool maps the input rows over these actors. Each actor is created inside a
placement group of its own (``ReplicaPlacement``): bundle 0 holds the actor, and when the
engine runs Ray workers (TP x PP > 1, or DP) the following bundles hold them, exactly as a
Serve replica's group does. An engine that dies takes its actor down with it
(``os._exit``): Ray then restarts the actor with a fresh engine and Ray Data retries the
batches it held, so their rows are never written with the dead engine's errors.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from raylm.cluster.batch.rows import DEFAULT_MAX_CONCURRENCY, BatchRunner
from raylm.cluster.serve.deployment.config import LLMConfig
from raylm.cluster.serve.handlers.serving import OpenAIServing

logger = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 75  # any non-zero exit is a crash to Ray: it restarts the actor


def replica_bundles(llm_config: LLMConfig) -> tuple[list[dict[str, float]], str]:
    """The placement group of one replica. An engine that runs in the replica's own process
    (TP = PP = DP = 1, no Ray executor) needs one bundle, the worker's; any other uses the
    Serve replica's layout (bundle 0 for the replica, then the ranks')."""
    pg = llm_config.get_placement_group()
    ek = llm_config.engine_kwargs
    in_process = (ek.world_size == 1 and ek.data_parallel_size == 1
                  and ek.distributed_executor_backend in (None, "uni"))
    if in_process and llm_config.placement_group_config is None:
        return [dict(pg.bundles[1])], pg.strategy
    return [dict(b) for b in pg.bundles], pg.strategy


class ReplicaPlacement:
    """Ray Data's ``ray_remote_args_fn``: reserves a new placement group for every replica
    actor it starts (autoscaling included) and remembers them for ``remove_all``."""

    def __init__(self, bundles: list[dict[str, float]], strategy: str) -> None:
        if not bundles:
            raise ValueError("a replica needs at least one bundle.")
        self.bundles = bundles
        self.strategy = strategy
        self.groups: list[Any] = []

    @property
    def actor_resources(self) -> dict[str, float]:
        """What the replica actor itself takes from bundle 0."""
        return {"num_cpus": self.bundles[0].get("CPU", 0.0),
                "num_gpus": self.bundles[0].get("GPU", 0.0)}

    def __call__(self) -> dict[str, Any]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Not waited for: an actor whose group is not placed yet stays pending, which is
        # how Ray Data sees a replica that autoscaling asked for and the cluster lacks.
        pg = placement_group(self.bundles, strategy=self.strategy,
                             name=f"raylm-batch-{uuid.uuid4().hex[:8]}")
        self.groups.append(pg)
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}

    def remove_all(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # already gone with the cluster
                logger.debug("remove_placement_group: %s", e)
        self.groups.clear()


class BatchReplica:
    """The Ray Data UDF: ``{"line_no", "line"}`` batches in, output lines out."""

    def __init__(self, llm_config: dict[str, Any], model_aliases: tuple[str, ...] = (),
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY) -> None:
        import ray

        from raylm.cluster.engine.async_llm import AsyncLLM

        config = LLMConfig.model_validate(llm_config)
        self.engine = AsyncLLM.from_llm_config(config)
        self.runner = BatchRunner(OpenAIServing.from_llm_config(self.engine, config),
                                  tuple(model_aliases), max_concurrency)
        self.replica_id = f"{ray.get_runtime_context().get_node_id()}:{os.getpid()}"

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        rows = [(int(no), str(line)) for no, line in zip(batch["line_no"], batch["line"])]
        results = await self.runner.run_rows(rows)
        if any(r.status >= 500 for r in results):
            error = await self.runner.engine_error()
            if error is not None:
                logger.error("raylm batch replica %s: the engine died (%s); exiting so that "
                             "Ray restarts this replica and retries its rows.",
                             self.replica_id, error)
                os._exit(EXIT_ENGINE_DEAD)
        return {
            "line_no": [no for no, _ in rows],
            "output": [r.text for r in results],
            "status": [r.status for r in results],
            "completion_tokens": [r.completion_tokens for r in results],
            "replica": [self.replica_id] * len(rows),
        }
