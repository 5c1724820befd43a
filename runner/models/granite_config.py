"""What Granite 4 (GraniteMoeHybrid: Mamba2 and attention layers, a shared MLP beside
optional experts) adds to the Llama-family decoder, read from config.json as transformers'
GraniteMoeHybridConfig reads it: the embedding scaled by ``embedding_multiplier``, each
layer's mixer and MLP outputs by ``residual_multiplier`` before the residual add,
``attention_multiplier`` as the attention scale, logits divided by ``logits_scaling``, and
RoPE only when ``position_embedding_type`` is "rope" (else no position embedding at all).
Fields raylm cannot honour are refused, each by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"


@dataclass(frozen=True)
class GraniteTraits:
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float
    logits_scaling: float
    use_rope: bool
    shared_intermediate_size: int  # the shared MLP's (every token runs it)


def granite_traits(hf: dict[str, Any]) -> GraniteTraits:
    position = hf.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise ValueError(f"position_embedding_type {position!r} is not supported "
                         "(only 'rope', or null / 'nope': no position embedding).")

    def number(name: str) -> float:
        value = hf.get(name, 1.0)
        if value is None:
            return 1.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}.")
        return float(value)

    return GraniteTraits(embedding_multiplier=number("embedding_multiplier"),
                         residual_multiplier=number("residual_multiplier"),
                         attention_multiplier=number("attention_multiplier"),
                         logits_scaling=number("logits_scaling"),
                         use_rope=position == "rope",
                         shared_intermediate_size=int(hf.get("shared_intermediate_size", 1024)))
