"""The decoder shape read from a Hugging Face config.json, for the Llama family (Gemma 3's
additions: runner/models/gemma_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raylm.runner.models.gemma_config import GemmaTraits, gemma3_traits
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
    # Mixture of experts (Qwen3-MoE): per layer whether its MLP is the sparse block
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    # Gemma 3 (None for the others): its norms, scales, activation and two RoPE tables
    gemma: GemmaTraits | None = field(compare=False, repr=False)
    hf_config: dict[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        arch = resolve_architecture(hf.get("architectures") or [])
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // heads)
        gemma = gemma3_traits(hf, head_dim) if arch == "Gemma3ForCausalLM" else None
        act = hf.get("hidden_act", "silu")
        if gemma is None and act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu').")
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma is not None)),
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
            o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            layer_windows=tuple(layer_windows(arch, hf)),
            moe_layers=tuple(_moe_layers(arch, hf)),
            num_experts=_num_experts(hf),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            gemma=gemma,
            hf_config=hf,
        )


def _moe_layers(arch: str, hf: dict[str, Any]) -> list[bool]:
    """Which layers' MLP is the sparse expert block, as transformers' Qwen3-MoE decides:
    every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
    num_layers = int(hf["num_hidden_layers"])
    if arch != "Qwen3MoeForCausalLM" or not _num_experts(hf):
        return [False] * num_layers
    step = int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def _num_experts(hf: dict[str, Any]) -> int:
    """``num_experts`` (the hub's Qwen3-MoE configs) or ``num_local_experts`` (what
    transformers 5 writes)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
