"""What users receive: vLLM-compatible RequestOutput / CompletionOutput / Logprob."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: {token_id: Logprob} for the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token, the same dict for the prompt token and the top-k; the first
# token has no logprob (None), as in vLLM.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = field(default=None)  # set when the engine died under the request
    # An embedding request's pooled vector (SamplingParams.pooling), with its final output.
    pooled: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's: one prompt's embedding (``LLM.embed``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_request_output(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        if output.pooled is None:
            raise RuntimeError(f"request {output.request_id!r} finished without its "
                               f"embedding ({output.error or 'no pooled vector'})")
        return cls(output.request_id, output.prompt_token_ids, EmbeddingOutput(output.pooled))
