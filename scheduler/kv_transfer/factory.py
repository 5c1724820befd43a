"""The scheduler side of the configured KV connector (None without one)."""

from __future__ import annotations

from collections.abc import Callable

from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.kv_transfer.base import KVConnectorScheduler
from raylm.scheduler.kv_transfer.fault_injection import FaultInjectingScheduler
from raylm.scheduler.kv_transfer.offloading import OffloadingConnectorScheduler
from raylm.scheduler.kv_transfer.ray_pd import RayKVConnectorScheduler


def make_connector_scheduler(config: EngineConfig, get_block_ids: Callable[[str], list[int]]
                             ) -> KVConnectorScheduler | None:
    kv = config.kv_transfer_config
    if kv is None:
        return None
    block_size = config.cache_config.block_size
    connector: KVConnectorScheduler
    if kv.is_offloading:
        connector = OffloadingConnectorScheduler(kv, block_size, get_block_ids=get_block_ids)
    else:
        connector = RayKVConnectorScheduler(
            kv, block_size, tp_size=config.parallel_config.tensor_parallel_size,
            get_block_ids=get_block_ids)
    faults = kv.fault_injection
    return connector if faults is None else FaultInjectingScheduler(connector, faults)
