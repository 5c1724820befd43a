"""The engine client interface the server is written against (injectable for tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from raylm.cluster.engine.outputs import RequestOutput
from raylm.scheduler.config.engine_config import ModelConfig
from raylm.scheduler.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    model_config: ModelConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerBase

    def generate(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield CUMULATIVE RequestOutputs (text and token_ids so far, one CompletionOutput
        per n) as tokens arrive; the last has finished=True. Raises ValueError for bad
        input (over-long prompt, ...) before anything is yielded, EngineDeadError when the
        engine dies. Cancelling the iterator (client gone) aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raise EngineDeadError once the engine is dead."""
        ...

    def get_stats(self) -> dict[str, Any]:
        """Gauges and counters: num_requests_running, num_requests_waiting,
        kv_cache_usage_perc, num_preemptions_total, prompt_tokens_total,
        generation_tokens_total, prefix_cache_queries_total, prefix_cache_hits_total."""
        ...

    def shutdown(self) -> None: ...
