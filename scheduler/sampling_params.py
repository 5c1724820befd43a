"""Sampling parameters, with vLLM's fields, defaults and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from raylm.scheduler.pooling_params import PoolingParams
from raylm.scheduler.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# The most top logprobs a request may ask for per token by default (vLLM's default
# max_logprobs; the engine argument ``max_logprobs`` sets it, the intake checks it).
MAX_LOGPROBS = 20
# What every integer field must fit: the runner keeps them in int64 columns.
_INT64_MAX = 2**63 - 1
# logit_bias values are clamped to this range, as OpenAI documents it (and vLLM does).
LOGIT_BIAS_LIMIT = 100.0


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request carries, as vLLM's.

    CUMULATIVE: everything so far (token ids, text, logprobs), every step.
    DELTA: only what is new since the request's previous output.
    FINAL_ONLY: no output until the request finishes, then everything (what the offline
    ``LLM.generate`` uses: it reads only final outputs, so nothing is built per step)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Frozen: a request's params never change in flight.
    Each field's note says what it does; ``_verify`` names the allowed values."""

    n: int = 1
    """Completions to generate for the prompt (they share its prefix's KV blocks)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit per time it occurs in the output."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output."""
    temperature: float = 1.0
    """0 is greedy: the truncation knobs below are then reset to their no-op values."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k (stored as 0)."""
    min_p: float = 0.0
    seed: int | None = None
    """Seeds the request's own stateless RNG: the same tokens in any batch and mode."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Strings that end the request (a list or one string is accepted, stored as a tuple)."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None means up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens are out."""
    logprobs: int | None = None
    """The sampled token's logprob plus the top k (raw model logprobs, as vLLM's default
    ``raw_logprobs``)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    """Added to the logits of those token ids before any other processing (OpenAI's and
    vLLM's semantics; values clamped to [-100, 100]). The intake checks the ids against
    the vocabulary."""
    pooling: PoolingParams | None = None
    """An embedding request (scheduler/pooling_params.py): the prompt's hidden states
    pooled into ``RequestOutput.pooled``; the one sampled token is not part of the answer."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each RequestOutput carries (see RequestOutputKind); the engine computes the
    same either way."""
    extra_args: dict[str, Any] | None = field(default=None, compare=False)
    """Arguments for engine extensions (vLLM's name); ``"kv_transfer_params"`` tells a KV
    connector to send this request's KV to a peer or pull it from one."""

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _clamped_bias(self.logit_bias))
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy ignores the truncation knobs; normalise them so batching is uniform.
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 0)
            object.__setattr__(self, "min_p", 0.0)

    def _verify(self) -> None:
        def bad(name: str, value: object, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {value!r}.")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, v, "must be a finite number")
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
                     "prompt_logprobs"):
            v = getattr(self, name)
            if isinstance(v, int) and not -_INT64_MAX <= v <= _INT64_MAX:
                raise bad(name, v, f"must be at most {_INT64_MAX} in magnitude")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be at least 1")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, v, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be greater than zero")
        if not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be 0 or -1 (disable), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be less than or equal to max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, value, "must be a non-negative integer (the engine's "
                                       "max_logprobs bounds it)")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t <= _INT64_MAX:
                raise bad("stop_token_ids", list(self.stop_token_ids), "must be non-negative integers")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", list(self.stop), "must be non-empty strings")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs,
                      "must be a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "must be a RequestOutputKind")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", self.extra_args, "must be a dict")
        if self.stop and not self.detokenize:
            raise bad("stop", list(self.stop), "needs detokenize=True (stop strings match text)")
        if self.pooling is not None:
            self._verify_pooling(bad)

    def _verify_pooling(self, bad: Any) -> None:
        if not isinstance(self.pooling, PoolingParams):
            raise bad("pooling", self.pooling, "must be a PoolingParams")
        for name, allowed in (("n", 1), ("max_tokens", 1), ("logprobs", None),
                              ("prompt_logprobs", None), ("structured_outputs", None)):
            if getattr(self, name) != allowed:
                raise bad(name, getattr(self, name),
                          f"must be {allowed} for an embedding request (pooling)")

    @property
    def pools_every_prompt_row(self) -> bool:
        """Mean-pooled embeddings: every prompt position must be computed here (no
        prefix-cache hit, no loaded KV)."""
        return self.pooling is not None and self.pooling.needs_every_prompt_row

    @property
    def needs_output_history(self) -> bool:
        """True when sampling reads previously generated tokens (penalties)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)


def _clamped_bias(bias: Any) -> dict[int, float]:
    """``{token id: bias}`` with integer ids and finite biases clamped to +-100; ValueError
    naming logit_bias otherwise."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got "
                         f"{type(bias).__name__}.")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= _INT64_MAX:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), "
                             f"got {token!r}.")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for "
                             f"token {token}.")
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
    return out
