"""What Falcon-H1 adds to the Llama-family decoder, read from config.json as transformers'
FalconH1Config reads it: every layer runs a Mamba2 mixer and attention side by side on the
same normalised input (attention's input scaled by ``attention_in_multiplier``, the two
outputs by ``ssm_out_multiplier`` and ``attention_out_multiplier``, then summed), keys
scaled by ``key_multiplier``, the MLP's gate by ``mlp_multipliers[0]`` before its
activation and its output by ``mlp_multipliers[1]``, the embedding by
``embedding_multiplier`` and the logits by ``lm_head_multiplier``. The Mamba2 mixer's own
muP (``ssm_in_multiplier``, ``ssm_multipliers``) and optional norm are its shape's
(scheduler/config/mamba2_shape.py). Fields raylm cannot honour are refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FALCON_H1 = "FalconH1ForCausalLM"


@dataclass(frozen=True)
class FalconTraits:
    embedding_multiplier: float
    lm_head_multiplier: float
    key_multiplier: float
    attention_in_multiplier: float
    attention_out_multiplier: float
    ssm_out_multiplier: float
    mlp_gate_multiplier: float
    mlp_down_multiplier: float


def falcon_traits(hf: dict[str, Any]) -> FalconTraits:
    if hf.get("projectors_bias", False):
        raise ValueError("projectors_bias=True is not supported (Falcon-H1's Mamba2 output "
                         "projection without a bias only).")
    mlp = hf.get("mlp_multipliers") or [1.0, 1.0]
    if len(mlp) != 2:
        raise ValueError(f"mlp_multipliers must have 2 entries (gate, down), got {mlp!r}.")

    def number(name: str) -> float:
        value = hf.get(name)
        return 1.0 if value is None else float(value)

    return FalconTraits(embedding_multiplier=number("embedding_multiplier"),
                        lm_head_multiplier=number("lm_head_multiplier"),
                        key_multiplier=number("key_multiplier"),
                        attention_in_multiplier=number("attention_in_multiplier"),
                        attention_out_multiplier=number("attention_out_multiplier"),
                        ssm_out_multiplier=number("ssm_out_multiplier"),
                        mlp_gate_multiplier=float(mlp[0]), mlp_down_multiplier=float(mlp[1]))
