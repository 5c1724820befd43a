"""The engine client interface the server is written against (injectable for tests)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol, runtime_checkable

from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import InputProcessor, ValidatedPrompt
from raylm.scheduler.config.engine_config import ModelConfig


@runtime_checkable
class EngineClient(Protocol):
    model_config: ModelConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    input_processor: InputProcessor  # the intake: every prompt goes through it once

    def generate(self, prompt: ValidatedPrompt,
                 request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield CUMULATIVE RequestOutputs (text and token_ids so far, one CompletionOutput
        per n) as tokens arrive; the last has finished=True. Raises ValueError for a request
        the engine cannot take (InvalidRequestError: e.g. larger than its KV pool) before
        anything is yielded, EngineDeadError when the engine dies. Closing the iterator
        before the last output (client gone) aborts the request: callers never abort."""
        ...

    async def check_health(self) -> None:
        """Raise EngineDeadError once the engine is dead."""
        ...

    def get_stats(self) -> dict[str, Any]:
        """Gauges and counters: num_requests_running, num_requests_waiting,
        kv_cache_usage_perc, num_preemptions_total, prompt_tokens_total,
        generation_tokens_total, prefix_cache_queries_total, prefix_cache_hits_total."""
        ...

    def shutdown(self) -> None: ...


@runtime_checkable
class KVPoolSized(Protocol):
    """An engine that knows its KV pool (AsyncLLM; a custom engine factory's may not)."""

    @property
    def num_kv_blocks(self) -> int | None:
        """The KV pool in blocks (every DP rank's); None while not known."""
        ...
