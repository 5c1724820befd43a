"""Which layers of a hybrid checkpoint are state-space (Mamba2) mixers rather than
attention, read from config.json as transformers reads it.

Bamba: attention at ``attn_layer_indices``, Mamba2 everywhere else. Granite 4
(GraniteMoeHybrid): per ``layer_types`` entry, "mamba" (transformers 5 writes
"linear_attention") or "attention" ("full_attention"); all Mamba2 when absent. A model with
such layers keeps per-request recurrent state (runner/state_cache.py), which today means:
no prefix caching (a state is not cached per block), no KV connector (a loaded prefix
would arrive without its state), no LoRA on the mixers, and speculative decoding without
pipeline parallelism; the engine refuses the last three by name and turns prefix caching
off.
"""

from __future__ import annotations

from typing import Any, Literal

LayerMixer = Literal["attention", "mamba2"]
STATE_SPACE_ARCHITECTURES = ("BambaForCausalLM", "GraniteMoeHybridForCausalLM")
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
    if architecture != "BambaForCausalLM":
        return ["attention"] * num_layers
    indices = hf.get("attn_layer_indices") or []
    bad = [i for i in indices if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"attn_layer_indices {bad} are not layers of a "
                         f"{num_layers}-layer model.")
    return ["attention" if i in indices else "mamba2" for i in range(num_layers)]


def has_state_layers(architecture: str, hf: dict[str, Any]) -> bool:
    return "mamba2" in layer_mixers(architecture, hf)
