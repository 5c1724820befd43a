"""Ray actors: the EngineCore actor and its client (any data_parallel_size), worker actors
and the executor that drives them."""

from raylm.actors.engine_core_actor import EngineCoreActor
from raylm.actors.placement import PlacementGroupError
from raylm.actors.ray_engine_core_client import RayEngineCoreClient, make_ray_engine_core_client
from raylm.actors.ray_executor import RayExecutor
from raylm.actors.worker_actor import WorkerActor

__all__ = [
    "EngineCoreActor",
    "PlacementGroupError",
    "RayEngineCoreClient",
    "RayExecutor",
    "WorkerActor",
    "make_ray_engine_core_client",
]
