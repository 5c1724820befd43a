"""The OpenAI completion request (with vLLM's sampling extras) and the base every request

Requests convert themselves to a ``SamplingParams``; that conversion is the only one, used
by the HTTP server and by batch runs alike. Fields a client sends that no model here
declares are accepted and logged (as vLLM does: new OpenAI fields appear often), except
those in ``UNSUPPORTED_FIELDS``: OpenAI's and vLLM's fields that would change the output
and that raylm does not implement, refused with a 400 naming them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raylm.cluster.serve.openai_api.structured_outputs import (
    ResponseFormat,
    StructuredOutputsRequest,
    to_structured_outputs_params,
)
from raylm.scheduler.sampling_params import SamplingParams
from raylm.scheduler.structured.params import StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # OpenAI clients send fields this server does not know (and new ones appear often):
    # accept them (UNSUPPORTED_FIELDS lists the ones that are refused), as vLLM does.
    model_config = ConfigDict(extra="allow")


def _never(_: Any) -> bool:
    return False


def _falsy(value: Any) -> bool:
    return not value


# Request fields that change the output and that raylm does not implement: field -> (which
# values are accepted anyway: those that ask for nothing, what raylm does instead).
# Fields that do not change the output (store, metadata, service_tier, prediction...) are
# not listed: like any unknown field they are accepted and logged.
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # OpenAI
    "functions": (_falsy, "deprecated by OpenAI; send tools"),
    "function_call": (_falsy, "deprecated by OpenAI; send tool_choice"),
    "audio": (lambda v: v is None, "raylm generates text only"),
    "modalities": (lambda v: not v or list(v) == ["text"], "raylm generates text only"),
    "web_search_options": (lambda v: v is None, "raylm has no web search"),
    "reasoning_effort": (lambda v: v is None, "raylm has no reasoning-effort control"),
    "verbosity": (lambda v: v is None, "raylm has no verbosity control"),
    "best_of": (lambda v: v in (None, 1), "raylm returns every sampled completion (n)"),
    "suffix": (_falsy, "raylm has no fill-in-the-middle"),
    "dimensions": (lambda v: v is None, "raylm returns embeddings of the model's hidden size"),
    # vLLM extras
    "use_beam_search": (_falsy, "raylm has no beam search"),
    "length_penalty": (lambda v: v in (None, 1, 1.0), "raylm has no beam search"),
    "prompt_logprobs": (lambda v: v is None, "send echo with logprobs on /v1/completions"),
    "truncate_prompt_tokens": (lambda v: v is None, "raylm never truncates a prompt"),
    "allowed_token_ids": (lambda v: v is None, "send logit_bias"),
    "bad_words": (_falsy, "send logit_bias"),
    "priority": (lambda v: v in (None, 0), "raylm schedules first come, first served"),
    "return_tokens_as_token_ids": (_falsy, "raylm returns tokens as text"),
    "echo": (_falsy, "echo is a /v1/completions field"),  # on chat (vLLM's extra)
    "documents": (_falsy, "raylm renders messages and tools only"),
    "mm_processor_kwargs": (_falsy, "raylm serves text only"),
    "guided_json": (lambda v: v is None, "send structured_outputs.json"),
    "guided_regex": (lambda v: v is None, "send structured_outputs.regex"),
    "guided_choice": (lambda v: v is None, "send structured_outputs.choice"),
    "guided_grammar": (lambda v: v is None, "send structured_outputs.grammar"),
    "guided_decoding_backend": (lambda v: v is None, "raylm's backend is xgrammar"),
    "guided_whitespace_pattern": (lambda v: v is None,
                                  "send structured_outputs.disable_any_whitespace"),
    "vllm_xargs": (_falsy, "raylm has no engine extensions"),
}


def refused_fields(request: BaseModel) -> list[str]:
    """The request's fields that raylm refuses, each with why (see UNSUPPORTED_FIELDS)."""
    extra = request.model_extra or {}
    out = []
    for name, value in extra.items():
        rule = UNSUPPORTED_FIELDS.get(name)
        if rule is not None and not rule[0](value):
            out.append(f"{name} ({rule[1]})")
    return out


def ignored_fields(request: BaseModel) -> list[str]:
    """Fields the request carries that no model declares and that are not refused."""
    return sorted(k for k in (request.model_extra or {})
                  if k not in UNSUPPORTED_FIELDS)


def as_prompts(p: Any) -> list[str | list[int]]:
    """A prompt field (completions' ``prompt``, embeddings' ``input``: a text, texts, token
    ids, lists of them) as a list of prompts, each text or token ids."""
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [p]  # one prompt given as token ids
    return list(p)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# Bounds the schema states (so /openapi.json describes them and fuzzing mostly sends what
# the engine takes); SamplingParams and the intake check the rest and say why.
_INT64 = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT64)]
Count = Annotated[int, Field(ge=0, le=_INT64)]


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-_INT64, le=_INT64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=_INT64)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Token id (as a string, OpenAI's form) -> bias added to its logit, clamped to +-100.
    logit_bias: dict[str, float] | None = None
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

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint (ValueError naming the field when malformed)."""
        return to_structured_outputs_params(self.response_format, self.structured_outputs)

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (vLLM's semantics); ValueError naming it
        for a key that is not a token id."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got "
                                 f"{key!r}.")
            out[int(key)] = value
        return out

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
            structured_outputs=self.structured_outputs_params(),
            logit_bias=self.token_bias(),
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, repetition_penalty=self.repetition_penalty)
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = 16
    logprobs: Count | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
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
        return as_prompts(self.prompt)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if self.echo_without_generation:
            max_tokens = 1
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)




