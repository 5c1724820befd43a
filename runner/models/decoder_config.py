"""The decoder shape read from a Hugging Face config.json, for the Llama family (Gemma 3's
additions: runner/models/gemma_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from raylm.runner.models.falcon_h1_config import FALCON_H1, FalconTraits, falcon_traits
from raylm.runner.models.gemma_config import GemmaTraits, gemma_traits
from raylm.runner.models.granite_config import GRANITE_HYBRID, GraniteTraits, granite_traits
from raylm.runner.models.registry import resolve_architecture
from raylm.scheduler.config.attention_layout import layer_windows
from raylm.scheduler.config.gdn_shape import GatedDeltaShape
from raylm.scheduler.config.mamba2_shape import Mamba2Shape
from raylm.scheduler.config.mla_shape import MLAShape
from raylm.scheduler.config.moe_layout import (
    DEEPSEEK_V3,
    GroupedSigmoidRouting,
    moe_layers,
    moe_traits,
)
from raylm.scheduler.config.state_layout import LayerMixer, layer_mixers

QKNorm = Literal["none", "head", "projection"]
_QK_NORM: dict[str, QKNorm] = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head",
                               "Gemma3ForCausalLM": "head", "OlmoeForCausalLM": "projection",
                               "Qwen3NextForCausalLM": "head"}
# Partial rotary embeddings when the config does not say (transformers' defaults)
_ROTARY_FACTOR = {"BambaForCausalLM": 0.5, "Qwen3NextForCausalLM": 0.25}


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
    # RMSNorm of q and k before RoPE: "head" over each head (Qwen3), "projection" over the
    # whole q and k projections (OLMoE), "none"
    qk_norm: QKNorm
    # Per layer: its sliding window (a token sees its last W keys, itself included), or None
    layer_windows: tuple[int | None, ...]
    # Mixture of experts: per layer whether its MLP is the sparse block
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    # Qwen2-MoE: a dense shared expert beside the routed ones, scaled by a sigmoid gate (0: none)
    shared_expert_intermediate_size: int
    # Gemma 2 and 3 (None for the others): norms, scales, caps, activation, RoPE tables
    gemma: GemmaTraits | None = field(compare=False, repr=False)
    hf_config: dict[str, Any] = field(compare=False, repr=False)
    # Per layer: attention or a Mamba2 mixer (hybrid models: Bamba), and the mixers' shape
    layer_mixers: tuple[LayerMixer, ...] = ()
    mamba: Mamba2Shape | None = None
    # Granite 4 (None for the others): multipliers, RoPE or none, the shared MLP's size
    granite: GraniteTraits | None = field(default=None, compare=False, repr=False)
    shared_expert_gated: bool = True  # Qwen2-MoE's shared expert's sigmoid gate
    # Qwen3-Next: gated delta net mixers' shape, norms scaling by 1 + weight (as Gemma's),
    # and attention whose output is gated by sigmoid(a projection q_proj carries per head)
    gated_delta: GatedDeltaShape | None = None
    offset_norms: bool = False
    attn_output_gate: bool = False
    # Falcon-H1 (None for the others): its muP multipliers
    falcon: FalconTraits | None = field(default=None, compare=False, repr=False)
    # DeepSeek-V3: latent attention's shape, and its grouped sigmoid router
    mla: MLAShape | None = None
    grouped_sigmoid: GroupedSigmoidRouting | None = None

    @property
    def has_state_layers(self) -> bool:
        """Whether some layer is a recurrent mixer (Mamba2, gated delta net)."""
        return self.mamba is not None or self.gated_delta is not None

    @property
    def rope_config(self) -> dict[str, Any]:
        """The config RoPE reads: Bamba rotates half of each head and Qwen3-Next a quarter
        unless the config says otherwise (transformers' defaults)."""
        hf = self.hf_config
        params = hf.get("rope_parameters")
        given = "partial_rotary_factor" in hf or (isinstance(params, dict)
                                                  and "partial_rotary_factor" in params)
        if self.architecture in _ROTARY_FACTOR and not given:
            return {**hf, "partial_rotary_factor": _ROTARY_FACTOR[self.architecture]}
        return hf

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        arch = resolve_architecture(hf.get("architectures") or [])
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // heads)
        gemma = (gemma_traits(arch, hf, head_dim)
                 if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM") else None)
        act = hf.get("hidden_act", "silu")
        if gemma is None and act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu').")
        attention_bias = bool(hf.get("attention_bias", False))
        moe = moe_traits(arch, hf)
        mixers = layer_mixers(arch, hf)
        granite = granite_traits(hf) if arch == GRANITE_HYBRID else None
        # Granite without experts: its shared MLP is the layer's dense MLP.
        intermediate = (granite.shared_intermediate_size
                        if granite is not None and not moe.num_experts
                        else int(hf["intermediate_size"]))
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        # Qwen2 always has q/k/v biases; Qwen2-MoE as its qkv_bias says (transformers 5)
        qkv_bias = bool(hf.get("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM" else qwen2
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma is not None)),
            qkv_bias=qkv_bias or (not qwen2 and attention_bias),
            o_bias=False if qwen2 else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=_QK_NORM.get(arch, "none"),
            layer_windows=tuple(layer_windows(arch, hf)),
            moe_layers=tuple(moe_layers(arch, hf)),
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.intermediate_size,
            norm_topk_prob=moe.norm_topk_prob,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
            gemma=gemma,
            hf_config=hf,
            layer_mixers=tuple(mixers),
            mamba=(Mamba2Shape.from_hf(hf) if {"mamba2", "parallel"} & set(mixers)
                   else None),
            falcon=falcon_traits(hf) if arch == FALCON_H1 else None,
            gated_delta=GatedDeltaShape.from_hf(hf) if "gated_delta" in mixers else None,
            offset_norms=gemma is not None or arch == "Qwen3NextForCausalLM",
            attn_output_gate=arch == "Qwen3NextForCausalLM",
            granite=granite,
            shared_expert_gated=moe.shared_expert_gated,
            mla=MLAShape.from_hf(hf) if arch == DEEPSEEK_V3 else None,
            grouped_sigmoid=moe.grouped_sigmoid,
        )

