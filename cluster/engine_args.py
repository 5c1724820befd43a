"""Engine arguments as users pass them (vLLM's names) and their translation to EngineConfig."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from raylm.scheduler.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


@dataclass(frozen=True)
class EngineArgs:
    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    placement_group_strategy: str = "PACK"
    dp_sync_interval: int = 16
    max_queued_requests: int | None = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}.")
        return cls(model=model, **kwargs)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def create_engine_config(self) -> EngineConfig:
        model_config = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len or 0, seed=self.seed,
            served_model_name=self.served_model_name,
        )
        max_len = model_config.max_model_len
        # Chunked prefill is always on, so the token budget need not cover max_model_len.
        budget = self.max_num_batched_tokens or max(2048, self.max_num_seqs)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                num_kv_blocks=self.num_kv_blocks, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                max_model_len=max_len, async_scheduling=self.async_scheduling,
                max_queued_requests=self.max_queued_requests,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,  # type: ignore[arg-type]
                placement_group_strategy=self.placement_group_strategy,
                dp_sync_interval=self.dp_sync_interval,
            ),
        )
