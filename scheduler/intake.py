"""The one check of a request's input against the model (docs/architecture.md §2).

``validate_prompt`` runs once per request, in the engine client's input processor, after the
prompt is tokenized. Nothing downstream checks the prompt again: the EngineCore checks only
what depends on its own state (request id in use, KV pool size, structured-output backend).
Pure Python, so it imports without torch or ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raylm.scheduler.request import InvalidRequestError, check_prompt_room
from raylm.scheduler.sampling_params import MAX_LOGPROBS, SamplingParams
from raylm.scheduler.structured.params import StructuredOutputsParams

StructuredOutputsCheck = Callable[[StructuredOutputsParams], None]


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; each a bound on work a single client can make the
    engine do. The engine arguments of the same names set them (cluster/engine/
    engine_args.py); the defaults here are theirs."""

    max_n: int = 128
    """Completions per prompt (``n``): each is a sequence in the batch."""
    max_logprobs: int = MAX_LOGPROBS
    """Top logprobs per token (``logprobs``, ``top_logprobs``, ``prompt_logprobs``)."""
    max_stop_strings: int = 64
    """Stop strings (each is matched against every step's new text)."""
    max_stop_string_chars: int = 1024
    max_logit_bias: int = 1024
    """Entries of ``logit_bias``."""
    max_structured_output_chars: int = 65536
    """Length of a structured-output spec (JSON schema text, regex, grammar, choices)."""
    grammar_compile_timeout_s: float = 10.0
    """Seconds a spec may take to compile (the check the callers of ``validate_prompt``
    hand it: the server runs it off its event loop and gives up after this)."""

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop_strings", "max_stop_string_chars", "max_logit_bias",
                     "max_structured_output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be at least 1, got {value!r}.")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs!r}.")
        timeout = self.grammar_compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not timeout > 0 or timeout == float("inf"):
            raise ValueError(f"grammar_compile_timeout_s must be a positive number of "
                             f"seconds, got {timeout!r}.")


def structured_output_chars(so: StructuredOutputsParams) -> int:
    """The size of a spec as the limit counts it: its canonical text."""
    if so.choice is not None:
        return sum(len(c) for c in so.choice)
    return len(so.spec)


def check_limits(params: SamplingParams, limits: RequestLimits,
                 vocab_size: int | None = None) -> None:
    """The request's params against ``limits`` and the vocabulary (token ids it names:
    ``stop_token_ids``, ``logit_bias``); InvalidRequestError naming the field."""
    if params.n > limits.max_n:
        raise InvalidRequestError(
            f"n={params.n} exceeds this server's limit of {limits.max_n} completions per "
            "prompt (max_n).", "n")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise InvalidRequestError(
                f"{name}={value} exceeds max_logprobs={limits.max_logprobs}, the most top "
                "logprobs per token this server returns (top_logprobs on chat).", name)
    if len(params.stop) > limits.max_stop_strings:
        raise InvalidRequestError(
            f"stop has {len(params.stop)} strings, more than the {limits.max_stop_strings} "
            "this server allows (max_stop_strings).", "stop")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise InvalidRequestError(
            f"a stop string has {longest} characters, more than the "
            f"{limits.max_stop_string_chars} this server allows (max_stop_string_chars).",
            "stop")
    bias = params.logit_bias or {}
    if len(bias) > limits.max_logit_bias:
        raise InvalidRequestError(
            f"logit_bias has {len(bias)} entries, more than the {limits.max_logit_bias} "
            "this server allows (max_logit_bias).", "logit_bias")
    if vocab_size is not None:
        for name, ids in (("logit_bias", bias), ("stop_token_ids", params.stop_token_ids)):
            bad = sorted(t for t in ids if not 0 <= t < vocab_size)
            if bad:
                raise InvalidRequestError(
                    f"{name} token ids {bad[:5]} are outside the vocabulary "
                    f"[0, {vocab_size}).", name)
    so = params.structured_outputs
    if so is not None and structured_output_chars(so) > limits.max_structured_output_chars:
        raise InvalidRequestError(
            f"the structured-output spec has {structured_output_chars(so)} characters, more "
            f"than the {limits.max_structured_output_chars} this server compiles "
            "(max_structured_output_chars).", "structured_outputs")


def validate_prompt(
    prompt_token_ids: Sequence[int], params: SamplingParams, *, max_model_len: int,
    vocab_size: int | None = None, strict_max_tokens: bool = False,
    check_structured_outputs: StructuredOutputsCheck | None = None,
    limits: RequestLimits | None = None,
) -> None:
    """Raise InvalidRequestError (a ValueError; HTTP 400) naming the field at fault.

    Checks, in this order: the prompt is not empty and leaves room to generate within
    ``max_model_len``; its ids are inside the vocabulary; the params keep within
    ``limits`` and name only token ids of the vocabulary (``check_limits``); the
    structured-output spec compiles (``check_structured_outputs`` raises ValueError when
    not, and may be slow: the server runs it ahead, off its event loop); with
    ``strict_max_tokens`` (the HTTP API) an explicit ``max_tokens`` fits beside the prompt,
    where the offline API lets ``Request`` cap it. ``params`` checked their own fields when
    they were built.
    """
    n = len(prompt_token_ids)
    check_prompt_room(n, max_model_len)
    if vocab_size is not None:
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}).",
                "prompt")
    check_limits(params, limits or RequestLimits(), vocab_size)
    if params.structured_outputs is not None and check_structured_outputs is not None:
        try:
            check_structured_outputs(params.structured_outputs)
        except InvalidRequestError:
            raise
        except ValueError as e:  # a spec that does not compile is the client's to fix
            raise InvalidRequestError(str(e)) from e
    if strict_max_tokens and params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt of {n} tokens + max_tokens {params.max_tokens} = "
            f"{n + params.max_tokens} tokens exceeds max_model_len={max_model_len} "
            "(the model's maximum context length); reduce the prompt or max_tokens.",
            "max_tokens")
