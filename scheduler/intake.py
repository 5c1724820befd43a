"""The one check of a request's input against the model (docs/architecture.md §2).

``validate_prompt`` runs once per request, in the engine client's input processor, after the
prompt is tokenized. Nothing downstream checks the prompt again: the EngineCore checks only
what depends on its own state (request id in use, KV pool size, structured-output backend).
Pure Python, so it imports without torch or ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from raylm.scheduler.request import InvalidRequestError, check_prompt_room
from raylm.scheduler.sampling_params import SamplingParams
from raylm.scheduler.structured.params import StructuredOutputsParams

StructuredOutputsCheck = Callable[[StructuredOutputsParams], None]


def validate_prompt(
    prompt_token_ids: Sequence[int], params: SamplingParams, *, max_model_len: int,
    vocab_size: int | None = None, strict_max_tokens: bool = False,
    check_structured_outputs: StructuredOutputsCheck | None = None,
) -> None:
    """Raise InvalidRequestError (a ValueError; HTTP 400) naming the field at fault.

    Checks, in this order: the prompt is not empty and leaves room to generate within
    ``max_model_len``; its ids are inside the vocabulary; the structured-output spec
    compiles (``check_structured_outputs`` raises ValueError when not); with
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
