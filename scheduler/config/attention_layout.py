"""Which layers of a checkpoint attend through a sliding window, read from config.json as
transformers reads it, and the refusal of any raylm cannot run.

raylm runs full causal attention on every layer. A Qwen2/Qwen3 config can ask for a window
on some layers (``use_sliding_window``, ``sliding_window``, ``max_window_layers``,
``layer_types``); run with full attention such a model gives other tokens than the model
does, so the config is refused, naming the field, unless no layer would use a window.
"""

from __future__ import annotations

from typing import Any

# Architectures whose config carries the sliding-window fields, and transformers' default
# max_window_layers for them (Qwen2Config / Qwen3Config).
WINDOW_FIELDS_DEFAULT_MAX_WINDOW_LAYERS = {"Qwen2ForCausalLM": 28, "Qwen3ForCausalLM": 28}
LAYER_KINDS = ("full_attention", "sliding_attention")


def windowed_layers(architecture: str, hf_config: dict[str, Any]) -> list[int]:
    """The layers that transformers runs with a sliding window (empty: none). ValueError
    for a ``layer_types`` entry that is no attention kind raylm knows."""
    if architecture not in WINDOW_FIELDS_DEFAULT_MAX_WINDOW_LAYERS:
        return []  # Llama: transformers reads none of these fields
    num_layers = int(hf_config["num_hidden_layers"])
    # transformers drops the window unless use_sliding_window is set.
    window = hf_config.get("sliding_window", 4096) if hf_config.get("use_sliding_window") else None
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        first = int(hf_config.get("max_window_layers",
                                  WINDOW_FIELDS_DEFAULT_MAX_WINDOW_LAYERS[architecture]))
        layer_types = ["sliding_attention" if window is not None and i >= first
                       else "full_attention" for i in range(num_layers)]
    unknown = sorted({t for t in layer_types if t not in LAYER_KINDS})
    if unknown:
        raise ValueError(f"layer_types {unknown} is not supported: raylm knows the layer kinds "
                         f"{list(LAYER_KINDS)}.")
    if window is None:
        return []  # a "sliding_attention" layer without a window attends to everything
    return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]


def check_attention_layout(architecture: str, hf_config: dict[str, Any], model: str) -> None:
    """ValueError naming the field when the checkpoint wants a layer raylm cannot run."""
    layers = windowed_layers(architecture, hf_config)
    if not layers:
        return
    field = "layer_types" if hf_config.get("layer_types") is not None else "max_window_layers"
    raise ValueError(
        f"use_sliding_window=True with sliding_window={hf_config.get('sliding_window', 4096)} "
        f"on layers {layers} of model {model!r} ({field}) is not supported: raylm runs full "
        "attention on every layer and would give other tokens than the model. Use a "
        "checkpoint without the window (use_sliding_window=false).")
