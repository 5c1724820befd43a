"""vLLM's engine arguments that raylm has no field for, as configs written for vLLM (or Ray
Serve LLM's ``engine_kwargs``) carry them.

Each is either accepted, where raylm already behaves as the value asks (the value is then
dropped: it changes nothing), or refused with the reason. raylm's own fields keep vLLM's
names where both have the argument (``max_num_batched_tokens``, ``enable_prefix_caching``,
``gpu_memory_utilization``, ``enforce_eager``, ``max_logprobs``, ``tool_call_parser``...),
so those need no entry here. A key that is neither is unknown; every refused and unknown
key of one call is named in a single ValueError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForeignArg:
    """``accepts(value)``: raylm already does what the value asks. ``why``: what raylm
    does instead, said when the value is refused."""

    accepts: Callable[[Any], bool]
    why: str


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _any(_: Any) -> bool:
    return True


VLLM_ARGS: dict[str, ForeignArg] = {
    "enable_chunked_prefill": ForeignArg(
        _is(True, None), "raylm always chunks long prompts (max_num_batched_tokens bounds a "
                         "step); it cannot be turned off"),
    "trust_remote_code": ForeignArg(
        _any, "raylm runs its own code for each supported architecture and never imports "
              "code from a checkpoint"),
    "hf_token": ForeignArg(
        _any, "raylm reads checkpoints from local folders (model_source) and never from the "
              "Hugging Face Hub"),
    "tokenizer_mode": ForeignArg(_is("auto", "hf"), "raylm uses the checkpoint's Hugging Face "
                                                    "tokenizer (tokenizer_mode auto)"),
    "kv_cache_dtype": ForeignArg(_is("auto", None), "raylm keeps the KV cache in the model's "
                                                    "dtype (kv_cache_dtype auto)"),
    "load_format": ForeignArg(_is("auto", "safetensors", "gguf"),
                              "raylm loads safetensors folders and GGUF files"),
    "task": ForeignArg(_is("auto", "generate"), "raylm serves text generation only"),
    "runner": ForeignArg(_is("auto", "generate"), "raylm serves text generation only"),
    "guided_decoding_backend": ForeignArg(_is("auto", "xgrammar"),
                                          "raylm's structured outputs run on xgrammar"),
    "scheduling_policy": ForeignArg(_is("fcfs"), "raylm schedules first come, first served"),
    "disable_log_stats": ForeignArg(_is(True), "raylm does not log periodic stats; its "
                                               "metrics are on /metrics"),
    "disable_custom_all_reduce": ForeignArg(_is(True), "raylm's all-reduce is "
                                                       "torch.distributed's"),
    "limit_mm_per_prompt": ForeignArg(_is(None), "raylm serves text only"),
    "revision": ForeignArg(_is(None, "main"), "raylm loads the checkpoint folder as it is"),
    "download_dir": ForeignArg(_is(None), "raylm downloads nothing but its default model"),
}
# enable_auto_tool_choice: tool_choice "auto" is served exactly when a tool_call_parser is
# set (checked with the other keys below).
_AUTO_TOOL_CHOICE = "enable_auto_tool_choice"


def vllm_refusals(kwargs: Mapping[str, Any], known: Collection[str]) -> list[str]:
    """One line per key of ``kwargs`` that is refused: a vLLM argument whose value raylm
    does not run, or a key raylm does not know at all (``known``: raylm's fields)."""
    lines = []
    for key, value in kwargs.items():
        if key in known:
            continue
        if key == _AUTO_TOOL_CHOICE:
            if value and not kwargs.get("tool_call_parser"):
                lines.append(f"{key}={value!r}: tool_choice 'auto' needs tool_call_parser "
                             "(hermes or llama3_json)")
            elif not value and kwargs.get("tool_call_parser"):
                lines.append(f"{key}={value!r}: with tool_call_parser set, tool_choice "
                             "'auto' is served; drop one of them")
            continue
        arg = VLLM_ARGS.get(key)
        if arg is None:
            continue  # unknown: listed apart
        if not arg.accepts(value):
            lines.append(f"{key}={value!r}: {arg.why}")
    return lines


def unknown_keys(kwargs: Mapping[str, Any], known: Collection[str]) -> list[str]:
    return sorted(k for k in kwargs
                  if k not in known and k not in VLLM_ARGS and k != _AUTO_TOOL_CHOICE)


def drop_accepted(kwargs: Mapping[str, Any], known: Collection[str]) -> dict[str, Any]:
    """``kwargs`` without the vLLM arguments that are accepted (or refused: call
    ``vllm_refusals`` first); raylm's own and unknown keys stay."""
    dropped = {k: v for k, v in kwargs.items()
               if k not in known and (k in VLLM_ARGS or k == _AUTO_TOOL_CHOICE)}
    if dropped:
        logger.info("vLLM engine arguments accepted with no effect (raylm already behaves "
                    "so): %s", dropped)
    return {k: v for k, v in kwargs.items() if k not in dropped}


def refusal_message(refused: list[str], unknown: list[str], known: Collection[str]) -> str:
    parts = []
    if refused:
        parts.append("refused engine argument(s): " + "; ".join(refused))
    if unknown:
        parts.append(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
    return ". ".join(parts) + "."


def translate_vllm_kwargs(kwargs: Mapping[str, Any], known: Collection[str]) -> dict[str, Any]:
    """``kwargs`` without the accepted vLLM arguments; ValueError naming every refused and
    unknown key at once."""
    refused = vllm_refusals(kwargs, known)
    unknown = unknown_keys(kwargs, known)
    if refused or unknown:
        raise ValueError(refusal_message(refused, unknown, known))
    return drop_accepted(kwargs, known)
