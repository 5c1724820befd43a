"""What Gemma 2 and Gemma 3 (text) add to the Llama-family decoder, read from config.json as
transformers' Gemma2Config and Gemma3TextConfig read them: norms that scale by
``1 + weight`` in float32, a norm after attention and around the MLP, the embedding scaled
by sqrt(hidden), GELU (tanh), ``query_pre_attn_scalar`` as the attention scale, attention
scores soft-capped by ``attn_logit_softcapping`` (Gemma 2 only), and RoPE: one table
for Gemma 2, two for Gemma 3 (the global layers' and the sliding layers',
``rope_local_base_freq``). Fields raylm cannot honour are refused, each by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylm.scheduler.config.attention_layout import gemma_layer_types

_SLIDING = "sliding_attention"


@dataclass(frozen=True)
class GemmaTraits:
    hidden_act: str
    embed_scale: float
    attn_scale: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    # The RoPE parameters of the global (0) and the sliding (1) layers, and each layer's.
    rope_params: tuple[dict[str, Any], dict[str, Any]]
    layer_rope: tuple[int, ...]


def gemma_traits(architecture: str, hf: dict[str, Any], head_dim: int) -> GemmaTraits:
    gemma2 = architecture == "Gemma2ForCausalLM"
    if not gemma2 and hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 caps scores in its eager attention only (sdpa, its default,
        # ignores the cap): no single answer to match.
        raise ValueError(f"attn_logit_softcapping={hf['attn_logit_softcapping']!r} is not "
                         "supported for Gemma 3 (transformers applies it in eager attention "
                         "only); it must be null.")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported: raylm's "
                         "attention is causal.")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported for Gemma (only "
                         "'gelu_pytorch_tanh').")
    params = hf.get("rope_parameters")
    if gemma2:
        global_rope = dict(params) if isinstance(params, dict) else {
            **dict(hf.get("rope_scaling") or {}),
            "rope_theta": float(hf.get("rope_theta", 10000.0))}
        local_rope = global_rope
    elif isinstance(params, dict) and "full_attention" in params:
        global_rope = dict(params["full_attention"])
        local_rope = dict(params.get(_SLIDING) or {"rope_theta": 10000.0})
    else:  # the configs written before transformers 5
        global_rope = dict(hf.get("rope_scaling") or {})
        global_rope["rope_theta"] = float(hf.get("rope_theta", 1_000_000.0))
        local_rope = {"rope_theta": float(hf.get("rope_local_base_freq", 10000.0))}
    shape = {"model_type": "llama", "head_dim": head_dim,
             "hidden_size": int(hf["hidden_size"]),
             "num_attention_heads": int(hf["num_attention_heads"]),
             "max_position_embeddings": int(hf.get("max_position_embeddings", 32768))}
    # Gemma 2's config defaults cap both; Gemma 3's neither.
    attn_cap = hf.get("attn_logit_softcapping", 50.0 if gemma2 else None)
    cap = hf.get("final_logit_softcapping", 30.0 if gemma2 else None)
    return GemmaTraits(
        hidden_act=act,
        embed_scale=float(hf["hidden_size"]) ** 0.5,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcapping=None if attn_cap is None else _positive(
            "attn_logit_softcapping", attn_cap),
        final_logit_softcapping=None if cap is None else _positive(
            "final_logit_softcapping", cap),
        rope_params=({**shape, "rope_parameters": global_rope},
                     {**shape, "rope_parameters": local_rope}),
        layer_rope=tuple(0 if gemma2 else int(t == _SLIDING)
                         for t in gemma_layer_types(architecture, hf)))


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number or null, got {value!r}.")
    return float(value)
