"""raylm.scheduler: pure-Python scheduling (no torch, no ray)."""

from raylm.scheduler.async_scheduler import AsyncScheduler
from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.scheduler.config.speculative_config import SpeculativeConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core.executor_base import EngineDeadError, Executor
from raylm.scheduler.core_outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from raylm.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from raylm.scheduler.kv.kv_cache_manager import KVCacheManager
from raylm.scheduler.request import Request, RequestStatus
from raylm.scheduler.sampling_params import SamplingParams
from raylm.scheduler.scheduler import Scheduler

__all__ = [
    "AsyncScheduler",
    "BlockPool",
    "CacheConfig",
    "CachedRequestData",
    "EngineConfig",
    "EngineCore",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineDeadError",
    "Executor",
    "FinishReason",
    "KVCacheBlock",
    "KVCacheManager",
    "LogprobsLists",
    "ModelConfig",
    "ModelRunnerOutput",
    "NewRequestData",
    "ParallelConfig",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SpeculativeConfig",
]
