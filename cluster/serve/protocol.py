"""The OpenAI request and response schemas (with vLLM's sampling extras), as pydantic models.

Requests convert themselves to a ``SamplingParams``; that conversion is the only one, used
by the HTTP server and by batch runs alike.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raylm.cluster.engine.outputs import Logprob, PromptLogprobs, SampleLogprobs
from raylm.cluster.serve.structured_outputs import (
    ResponseFormat,
    StructuredOutputsRequest,
    to_structured_outputs_params,
)
from raylm.scheduler.sampling_params import MAX_LOGPROBS, SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # OpenAI clients send fields this server does not know (and new ones appear often):
    # accept and ignore them, as vLLM does.
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs extra.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Build SamplingParams; raises ValueError naming the bad field."""
        kwargs: dict[str, Any] = dict(
            n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=to_structured_outputs_params(self.response_format,
                                                            self.structured_outputs),
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, repetition_penalty=self.repetition_penalty)
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.stream and self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported with stream (prompt logprobs "
                             "are returned in non-streaming responses)")
        if self.max_tokens == 0 and self.echo and self.stream:
            raise ValueError("max_tokens=0 (scoring the echoed prompt) is not supported with "
                             "stream")
        return self

    @property
    def echo_without_generation(self) -> bool:
        """echo with max_tokens=0: score the prompt only (lm-evaluation-harness's
        log-likelihood requests). The engine still samples one token, which is dropped."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (each text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # one prompt given as token ids
        return list(p)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if self.echo_without_generation:
            max_tokens = 1
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # a Jinja template replacing the model's (vLLM extra)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}")
        return self

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None),
                          default_max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


# ---- responses ---------------------------------------------------------------------------

class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _Choice(OpenAIBaseModel):
    """What every choice carries beside its content: which one, and why it ended (None
    until it has)."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response(OpenAIBaseModel):
    """The fields of every completion response, in OpenAI's order (a subclass narrows
    ``object`` and ``choices``; a field it redeclares keeps its place here)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None


class CompletionResponseChoice(_Choice):
    text: str
    logprobs: CompletionLogProbs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(_Choice):
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None


class ChatCompletionStreamChoice(_Choice):
    delta: dict[str, str]  # only the keys that changed: {"role": ...} first, then {"content": ...}
    logprobs: ChatLogProbs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice] | list[ChatCompletionStreamChoice]


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "raylm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---- logprobs: engine format (one {token_id: Logprob} per token) to OpenAI's two formats ----

def _token_text(token_id: int, lp: Logprob | None, decode: Callable[[int], str]) -> str:
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode(token_id)


def _top(entries: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    ranked = [(t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= top_n]
    return sorted(ranked, key=lambda item: item[1].rank)


def completion_logprobs(token_ids: list[int], logprobs: PromptLogprobs, top_n: int,
                        offset: int, decode: Callable[[int], str],
                        out: CompletionLogProbs | None = None) -> CompletionLogProbs:
    """Legacy completions format; ``offset`` is where the first token's text starts. A
    None entry (an echoed prompt's first token) has no logprob. Appends to ``out``."""
    out = out if out is not None else CompletionLogProbs()
    for token_id, entries in zip(token_ids, logprobs, strict=False):
        if entries is None:
            text = decode(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        sampled = entries.get(token_id)
        text = _token_text(token_id, sampled, decode)
        out.tokens.append(text)
        out.token_logprobs.append(sampled.logprob if sampled is not None else None)
        # Like vLLM, the sampled token is listed among the top ones even when outside the top-n.
        top = {_token_text(t, lp, decode): lp.logprob for t, lp in _top(entries, top_n)}
        if sampled is not None:
            top.setdefault(text, sampled.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, top_n: int,
                  decode: Callable[[int], str]) -> ChatLogProbs:
    content = []
    for token_id, entries in zip(token_ids, logprobs, strict=False):
        sampled = entries.get(token_id)
        text = _token_text(token_id, sampled, decode)
        top = []
        for t, lp in _top(entries, top_n):
            top_text = _token_text(t, lp, decode)
            top.append(ChatTopLogprob(token=top_text, logprob=max(lp.logprob, -9999.0),
                                      bytes=list(top_text.encode("utf-8", "replace"))))
        content.append(ChatTokenLogprob(
            token=text, logprob=max(sampled.logprob, -9999.0) if sampled else -9999.0,
            bytes=list(text.encode("utf-8", "replace")), top_logprobs=top))
    return ChatLogProbs(content=content)
