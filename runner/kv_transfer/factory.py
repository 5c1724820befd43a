"""The worker side of the configured KV connector for one rank (None without one)."""

from __future__ import annotations

from raylm.parallel.context import ParallelContext
from raylm.runner.kv_transfer.base import KVConnectorWorker
from raylm.runner.kv_transfer.offloading import OffloadingConnectorWorker
from raylm.runner.kv_transfer.ray_pd import RayKVConnectorWorker
from raylm.scheduler.config.engine_config import EngineConfig


def make_connector_worker(config: EngineConfig, ctx: ParallelContext
                          ) -> KVConnectorWorker | None:
    kv = config.kv_transfer_config
    if kv is None:
        return None
    if kv.is_offloading:
        return OffloadingConnectorWorker(config, ctx.tp_rank)
    return RayKVConnectorWorker(config, ctx.tp_rank, ctx.tp_size, ctx.tp_group)
