"""DiffusionGemma's shape, read from a ``DiffusionGemmaForBlockDiffusion`` config.json.

transformers' ``DiffusionGemmaTextConfig`` resolves the per-layer overrides (the global
layers' ``global_head_dim`` and ``num_global_key_value_heads``), so the text config is
read through it and then frozen here. Fields raylm cannot honour are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

DIFFUSION_GEMMA = "DiffusionGemmaForBlockDiffusion"
_SLIDING = "sliding_attention"


@dataclass(frozen=True)
class DiffusionLayerShape:
    layer_type: str  # "sliding_attention" or "full_attention" (its RoPE table's key)
    head_dim: int
    num_kv_heads: int
    # A token's window (itself included) in the encoder; in the decoder the canvas sees the
    # same prefix keys as its first token does. None: every key.
    sliding_window: int | None
    # The global layers have no v_proj: the value is k_proj's output, normalised apart.
    value_is_key: bool


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    max_position_embeddings: int
    # Tokens in one block of block diffusion: the canvas every denoising step rewrites.
    canvas_length: int
    tie_word_embeddings: bool
    layers: tuple[DiffusionLayerShape, ...]
    eos_token_id: tuple[int, ...]
    pad_token_id: int | None
    hf_config: dict[str, Any] = field(compare=False, repr=False)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers)

    def rope_inv_freq(self, layer_type: str) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim / 2] float32, cos/sin scaling) of one layer type, from
        transformers' RoPE functions (the global layers' "proportional" RoPE zero-pads
        its frequencies to the whole head)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        text = _text_config(self.hf_config)
        params = text.rope_parameters[layer_type]
        layer_cfg = text.per_layer_config[layer_type]
        if params["rope_type"] == "default":
            dim = int(layer_cfg.head_dim * params.get("partial_rotary_factor", 1.0))
            exponent = torch.arange(0, dim, 2, dtype=torch.float32) / dim
            return 1.0 / (float(params["rope_theta"]) ** exponent), 1.0
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](
            layer_cfg, torch.device("cpu"), layer_type=layer_type)
        return inv_freq.to(torch.float32), float(scaling)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DiffusionGemmaConfig:
        if DIFFUSION_GEMMA not in (hf.get("architectures") or []):
            raise ValueError(f"architectures {hf.get('architectures')!r} do not name "
                             f"{DIFFUSION_GEMMA}.")
        raw = hf.get("text_config") or {}
        if raw.get("use_bidirectional_attention") is not None:
            raise ValueError("use_bidirectional_attention="
                             f"{raw['use_bidirectional_attention']!r} is not supported: "
                             "raylm's encoder pass is causal (null only).")
        if raw.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported for DiffusionGemma.")
        text = _text_config(hf)
        if text.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {text.hidden_activation!r} is not supported "
                             "(only 'gelu_pytorch_tanh').")
        if not text.num_experts or not text.top_k_experts or not text.moe_intermediate_size:
            raise ValueError("num_experts, top_k_experts and moe_intermediate_size must be "
                             "set: every DiffusionGemma layer has its experts.")
        canvas = int(hf.get("canvas_length") or 0)
        if canvas < 1:
            raise ValueError(f"canvas_length must be positive, got {canvas}.")
        layers = []
        for i, layer_type in enumerate(text.layer_types):
            shape = text.per_layer_config[i]
            sliding = layer_type == _SLIDING
            layers.append(DiffusionLayerShape(
                layer_type=layer_type, head_dim=int(shape.head_dim),
                num_kv_heads=int(shape.num_key_value_heads),
                sliding_window=int(text.sliding_window) if sliding else None,
                value_is_key=not sliding))
        eos = text.eos_token_id
        cap = text.final_logit_softcapping
        return cls(
            architecture=DIFFUSION_GEMMA,
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            intermediate_size=int(text.intermediate_size),
            num_attention_heads=int(text.num_attention_heads),
            rms_norm_eps=float(text.rms_norm_eps),
            final_logit_softcapping=None if cap is None else float(cap),
            num_experts=int(text.num_experts),
            top_k_experts=int(text.top_k_experts),
            moe_intermediate_size=int(text.moe_intermediate_size),
            max_position_embeddings=int(text.max_position_embeddings),
            canvas_length=canvas,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            layers=tuple(layers),
            eos_token_id=tuple([] if eos is None else [eos] if isinstance(eos, int) else eos),
            pad_token_id=text.pad_token_id,
            hf_config=hf,
        )


def _text_config(hf: dict[str, Any]) -> Any:
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import (
        DiffusionGemmaTextConfig,
    )

    fields = {k: v for k, v in (hf.get("text_config") or {}).items() if k != "model_type"}
    return DiffusionGemmaTextConfig(**fields)
