"""Which layers of a hybrid checkpoint are recurrent mixers (Mamba2, gated delta net)
rather than attention, read from config.json as transformers reads it.

Bamba: attention at ``attn_layer_indices``, Mamba2 everywhere else. Granite 4
(GraniteMoeHybrid): per ``layer_types`` entry, "mamba" (transformers 5 writes
"linear_attention") or "attention" ("full_attention"); all Mamba2 when absent. Qwen3-Next:
gated delta net layers where ``layer_types`` says "linear_attention" (by default every
layer but each ``full_attention_interval``-th, 4). Falcon-H1: a Mamba2 mixer beside
attention in every layer. A model with
such layers keeps per-request recurrent state (runner/state_cache.py), which today means:
no prefix caching (a state is not cached per block), no KV connector (a loaded prefix
would arrive without its state), no LoRA on the mixers, and speculative decoding without
pipeline parallelism; the engine refuses the last three by name and turns prefix caching
off.
"""

from __future__ import annotations

from typing import Any, Literal

from raylm.scheduler.config.gdn_shape import GatedDeltaShape
from raylm.scheduler.config.mamba2_shape import Mamba2Shape

# "parallel": a Mamba2 mixer and attention side by side in one layer (Falcon-H1)
LayerMixer = Literal["attention", "mamba2", "gated_delta", "parallel"]
STATE_SPACE_ARCHITECTURES = ("BambaForCausalLM", "GraniteMoeHybridForCausalLM",
                             "Qwen3NextForCausalLM", "FalconH1ForCausalLM")
_QWEN3_NEXT_KINDS: dict[str, LayerMixer] = {"linear_attention": "gated_delta",
                                            "full_attention": "attention"}
_GRANITE_KINDS: dict[str, LayerMixer] = {"mamba": "mamba2", "linear_attention": "mamba2",
                                         "attention": "attention",
                                         "full_attention": "attention"}


def layer_mixers(architecture: str, hf: dict[str, Any]) -> list[LayerMixer]:
    """Per layer, what mixes its tokens; ValueError naming a bad field."""
    num_layers = int(hf.get("num_hidden_layers", 0))
    if architecture == "GraniteMoeHybridForCausalLM":
        kinds = hf.get("layer_types") or ["mamba"] * num_layers
        unknown = sorted({k for k in kinds if k not in _GRANITE_KINDS})
        if unknown or len(kinds) != num_layers:
            raise ValueError(f"layer_types must name {num_layers} layers, each one of "
                             f"{sorted(_GRANITE_KINDS)}; got {kinds!r}.")
        return [_GRANITE_KINDS[k] for k in kinds]
    if architecture == "Qwen3NextForCausalLM":
        interval = int(hf.get("full_attention_interval", 4))
        kinds = hf.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)]
        unknown = sorted({k for k in kinds if k not in _QWEN3_NEXT_KINDS})
        if unknown or len(kinds) != num_layers:
            raise ValueError(f"layer_types must name {num_layers} layers, each one of "
                             f"{sorted(_QWEN3_NEXT_KINDS)}; got {kinds!r}.")
        return [_QWEN3_NEXT_KINDS[k] for k in kinds]
    if architecture == "FalconH1ForCausalLM":
        return ["parallel"] * num_layers
    if architecture != "BambaForCausalLM":
        return ["attention"] * num_layers
    indices = hf.get("attn_layer_indices") or []
    bad = [i for i in indices if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"attn_layer_indices {bad} are not layers of a "
                         f"{num_layers}-layer model.")
    return ["attention" if i in indices else "mamba2" for i in range(num_layers)]


def has_state_layers(architecture: str, hf: dict[str, Any]) -> bool:
    return any(m != "attention" for m in layer_mixers(architecture, hf))


def recurrent_shapes(architecture: str, hf: dict[str, Any]
                     ) -> list[Mamba2Shape | GatedDeltaShape]:
    """The shapes of the model's recurrent mixers (one per kind it has); ValueError naming
    a field raylm cannot honour."""
    mixers = set(layer_mixers(architecture, hf))
    shapes: list[Mamba2Shape | GatedDeltaShape] = []
    if mixers & {"mamba2", "parallel"}:
        shapes.append(Mamba2Shape.from_hf(hf))
    if "gated_delta" in mixers:
        shapes.append(GatedDeltaShape.from_hf(hf))
    return shapes
