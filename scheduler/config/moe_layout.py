"""Which layers of a checkpoint are sparse mixtures of experts, and how their router picks,
read from config.json as transformers reads it for each family.

- Qwen3-MoE, Qwen2-MoE, Qwen3-Next: every ``decoder_sparse_step``-th layer not in
  ``mlp_only_layers``; top-k renormalised when ``norm_topk_prob``; Qwen2-MoE and Qwen3-Next
  add a shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate.
- Mixtral: every layer, ``num_local_experts`` experts of ``intermediate_size``, top-k always
  renormalised.
- OLMoE: every layer, top-k renormalised when ``norm_topk_prob``.
- Granite 4 (GraniteMoeHybrid): every layer when ``num_local_experts`` > 0, experts of
  ``intermediate_size``, top-k always renormalised (a softmax over the top-k logits), and a
  shared MLP of ``shared_intermediate_size`` added ungated.
- DeepSeek-V3: every layer from ``first_k_dense_replace`` on, ``n_routed_experts`` experts
  routed by sigmoid scores: the scores plus ``e_score_correction_bias`` choose, among the
  ``topk_group`` of ``n_group`` groups whose two best such scores sum highest, the top k;
  their plain scores, renormalised when ``norm_topk_prob``, are scaled by
  ``routed_scaling_factor``; ``n_shared_experts`` x ``moe_intermediate_size`` of shared
  expert added ungated.

A field that would change the computation and that raylm does not implement is refused by
name (ValueError), never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                     "OlmoeForCausalLM", "Qwen3NextForCausalLM", DEEPSEEK_V3)
# Granite 4: experts when num_local_experts > 0 (else its shared MLP alone, dense)
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
# Families whose sparse layers follow decoder_sparse_step / mlp_only_layers.
_STEPPED = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")


@dataclass(frozen=True)
class GroupedSigmoidRouting:
    """DeepSeek-V3's router (its fields as named in config.json)."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float


@dataclass(frozen=True)
class MoETraits:
    num_experts: int  # 0: a dense model
    top_k: int
    intermediate_size: int  # one routed expert's
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate; Granite's runs ungated
    grouped_sigmoid: GroupedSigmoidRouting | None = None  # None: a softmax router


def moe_traits(architecture: str, hf: dict[str, Any]) -> MoETraits:
    """The router and expert shapes; ValueError naming a field raylm cannot honour."""
    if architecture not in (*MOE_ARCHITECTURES, GRANITE_HYBRID):
        return MoETraits(0, 0, 0, False, 0)
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    if num_experts and not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], "
                         f"got {top_k}.")
    if architecture == DEEPSEEK_V3:
        return _deepseek_v3_traits(hf)
    if architecture == "MixtralForCausalLM":
        return MoETraits(num_experts, top_k, int(hf.get("intermediate_size") or 0), True, 0)
    if architecture == GRANITE_HYBRID:
        return MoETraits(num_experts, top_k, int(hf.get("intermediate_size") or 0), True,
                         int(hf.get("shared_intermediate_size", 1024)) if num_experts else 0,
                         shared_expert_gated=False)
    if architecture == "OlmoeForCausalLM":
        if hf.get("clip_qkv") is not None:
            raise ValueError(f"clip_qkv={hf['clip_qkv']!r} is not supported for OLMoE "
                             "(only null: q, k and v unclipped).")
        if hf.get("sliding_window") is not None:
            raise ValueError(f"sliding_window={hf['sliding_window']!r} is not supported for "
                             "OLMoE (only null: full attention, as its mask is).")
    shared = (int(hf.get("shared_expert_intermediate_size") or 0)
              if architecture in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM") else 0)
    return MoETraits(num_experts, top_k, int(hf.get("moe_intermediate_size")
                                             or hf.get("intermediate_size") or 0),
                     bool(hf.get("norm_topk_prob", False)), shared)


def _deepseek_v3_traits(hf: dict[str, Any]) -> MoETraits:
    num_experts = int(hf.get("n_routed_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                       ("moe_layer_freq", 1)):
        if hf.get(name, want) != want:
            raise ValueError(f"{name}={hf[name]!r} is not supported for DeepSeek-V3 (only "
                             f"{want!r}, as transformers' DeepseekV3 computes).")
    n_group, topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if n_group < 1 or num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={num_experts} "
                         "into groups of at least 2 experts.")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}.")
    if not 1 <= top_k <= num_experts * topk_group // n_group:
        raise ValueError(f"num_experts_per_tok must be in [1, experts in topk_group groups="
                         f"{num_experts * topk_group // n_group}], got {top_k}.")
    size = int(hf.get("moe_intermediate_size") or 0)
    return MoETraits(num_experts, top_k, size, bool(hf.get("norm_topk_prob", True)),
                     size * int(hf.get("n_shared_experts") or 0), shared_expert_gated=False,
                     grouped_sigmoid=GroupedSigmoidRouting(
                         n_group, topk_group, float(hf.get("routed_scaling_factor", 1.0))))


def moe_layers(architecture: str, hf: dict[str, Any]) -> list[bool]:
    """Per layer whether its MLP is the sparse expert block."""
    num_layers = int(hf.get("num_hidden_layers", 0))
    if not moe_traits(architecture, hf).num_experts:
        return [False] * num_layers
    if architecture == DEEPSEEK_V3:
        first_sparse = int(hf.get("first_k_dense_replace") or 0)
        return [i >= first_sparse for i in range(num_layers)]
    if architecture not in _STEPPED:
        return [True] * num_layers
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {step}.")
    dense = set(hf.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def check_moe_layout(architecture: str, hf: dict[str, Any]) -> None:
    """ValueError naming the field when the checkpoint's experts are not what raylm runs."""
    moe_layers(architecture, hf)
