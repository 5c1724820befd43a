"""What Gemma 3 (text) adds to the Llama-family decoder, read from config.json as
transformers' Gemma3TextConfig reads it: norms that scale by ``1 + weight`` in float32, a
norm after attention and around the MLP, the embedding scaled by sqrt(hidden), GELU (tanh),
``query_pre_attn_scalar`` as the attention scale, and two RoPE tables: the global layers'
and the sliding layers' (``rope_local_base_freq``). Fields raylm cannot honour are refused,
each by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylm.scheduler.config.attention_layout import gemma3_layer_types

_SLIDING = "sliding_attention"


@dataclass(frozen=True)
class GemmaTraits:
    hidden_act: str
    embed_scale: float
    attn_scale: float
    final_logit_softcapping: float | None
    # The RoPE parameters of the global (0) and the sliding (1) layers, and each layer's.
    rope_params: tuple[dict[str, Any], dict[str, Any]]
    layer_rope: tuple[int, ...]


def gemma3_traits(hf: dict[str, Any], head_dim: int) -> GemmaTraits:
    for name in ("attn_logit_softcapping",):
        if hf.get(name) is not None:
            raise ValueError(f"{name}={hf[name]!r} is not supported (attention logits are "
                             "never soft-capped here); it must be null.")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported: raylm's "
                         "attention is causal.")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported for Gemma 3 (only "
                         "'gelu_pytorch_tanh').")
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
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
    cap = hf.get("final_logit_softcapping")
    return GemmaTraits(
        hidden_act=act,
        embed_scale=float(hf["hidden_size"]) ** 0.5,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcapping=None if cap is None else float(cap),
        rope_params=({**shape, "rope_parameters": global_rope},
                     {**shape, "rope_parameters": local_rope}),
        layer_rope=tuple(int(t == _SLIDING) for t in gemma3_layer_types(hf)))
