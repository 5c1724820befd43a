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

A field that would change the computation and that raylm does not implement is refused by
name (ValueError), never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                     "OlmoeForCausalLM", "Qwen3NextForCausalLM")
# Granite 4: experts when num_local_experts > 0 (else its shared MLP alone, dense)
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
# Families whose sparse layers follow decoder_sparse_step / mlp_only_layers.
_STEPPED = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")


@dataclass(frozen=True)
class MoETraits:
    num_experts: int  # 0: a dense model
    top_k: int
    intermediate_size: int  # one routed expert's
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate; Granite's runs ungated


def moe_traits(architecture: str, hf: dict[str, Any]) -> MoETraits:
    """The router and expert shapes; ValueError naming a field raylm cannot honour."""
    if architecture not in (*MOE_ARCHITECTURES, GRANITE_HYBRID):
        return MoETraits(0, 0, 0, False, 0)
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    if num_experts and not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], "
                         f"got {top_k}.")
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


def moe_layers(architecture: str, hf: dict[str, Any]) -> list[bool]:
    """Per layer whether its MLP is the sparse expert block."""
    num_layers = int(hf.get("num_hidden_layers", 0))
    if not moe_traits(architecture, hf).num_experts:
        return [False] * num_layers
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
