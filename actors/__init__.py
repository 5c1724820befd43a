"""Ray actors: the EngineCore actor and its client (any data_parallel_size), worker actors
and the executor that drives them.

The names below load on first use: importing a module of this package (the Serve
router's ``raylm.actors.prefix_affinity``, in the ingress and proxy processes) must not
import torch with the executor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raylm.actors.engine_core_actor import EngineCoreActor
    from raylm.actors.placement import PlacementGroupError
    from raylm.actors.ray_engine_core_client import (
        RayEngineCoreClient,
        make_ray_engine_core_client,
    )
    from raylm.actors.ray_executor import RayExecutor
    from raylm.actors.worker_actor import WorkerActor

_HOMES = {
    "EngineCoreActor": "raylm.actors.engine_core_actor",
    "PlacementGroupError": "raylm.actors.placement",
    "RayEngineCoreClient": "raylm.actors.ray_engine_core_client",
    "RayExecutor": "raylm.actors.ray_executor",
    "WorkerActor": "raylm.actors.worker_actor",
    "make_ray_engine_core_client": "raylm.actors.ray_engine_core_client",
}

__all__ = [
    "EngineCoreActor",
    "PlacementGroupError",
    "RayEngineCoreClient",
    "RayExecutor",
    "WorkerActor",
    "make_ray_engine_core_client",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'raylm.actors' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
