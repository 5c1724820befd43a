"""The decoder shape read from a Hugging Face config.json, for the Llama family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raylm.runner.models.registry import resolve_architecture
from raylm.scheduler.config.attention_layout import layer_windows


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: always; Llama/Qwen3: attention_bias
    o_bias: bool  # Llama/Qwen3: attention_bias; Qwen2: never
    mlp_bias: bool  # Llama's mlp_bias
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before RoPE
    # Per layer: its sliding window (a token sees its last W keys, itself included), or None
    layer_windows: tuple[int | None, ...]
    hf_config: dict[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        arch = resolve_architecture(hf.get("architectures") or [])
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu').")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // heads
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
            o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            layer_windows=tuple(layer_windows(arch, hf)),
            hf_config=hf,
        )
