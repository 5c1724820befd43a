"""Which layers of a checkpoint attend through a sliding window, read from config.json as
transformers reads it.

Mistral and Mixtral put their ``sliding_window`` on every layer (Qwen3-MoE too, with
``use_sliding_window``); Qwen2/Qwen3/Qwen2-MoE on the layers their
``use_sliding_window``, ``sliding_window``, ``max_window_layers`` and ``layer_types`` say;
Gemma 2 and 3 on their ``sliding_attention`` layers (``layer_types``, else Gemma 2's every
other layer, Gemma 3's every layer but each ``sliding_window_pattern``-th).
A token of a windowed layer sees its last ``sliding_window`` keys, itself included
(transformers' window). A layer kind raylm does not know is refused, naming the field.
"""

from __future__ import annotations

from typing import Any

# Architectures whose config carries Qwen's window fields, and transformers' default
# max_window_layers for them (Qwen2Config / Qwen3Config).
QWEN_DEFAULT_MAX_WINDOW_LAYERS = {"Qwen2ForCausalLM": 28, "Qwen3ForCausalLM": 28,
                                  "Qwen2MoeForCausalLM": 28}
LAYER_KINDS = ("full_attention", "sliding_attention")
DEFAULT_WINDOW = 4096  # transformers' default sliding_window for these families


def gemma_layer_types(architecture: str, hf_config: dict[str, Any]) -> list[str]:
    """Gemma's ``layer_types``, or transformers' default: Gemma 2 alternates sliding and
    global layers; Gemma 3 makes every ``sliding_window_pattern``-th layer global."""
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        return list(layer_types)
    pattern = (2 if architecture == "Gemma2ForCausalLM"
               else int(hf_config.get("sliding_window_pattern", 6)))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(int(hf_config.get("num_hidden_layers", 0)))]


def layer_windows(architecture: str, hf_config: dict[str, Any]) -> list[int | None]:
    """Per layer: its window in tokens, or None for full attention. ValueError for a
    ``layer_types`` entry that is no attention kind raylm knows."""
    num_layers = int(hf_config.get("num_hidden_layers", 0))
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return _by_kind(gemma_layer_types(architecture, hf_config),
                        hf_config.get("sliding_window", DEFAULT_WINDOW), num_layers)
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        # transformers' defaults: Mistral 4096, Mixtral none
        window = hf_config.get("sliding_window", DEFAULT_WINDOW
                               if architecture == "MistralForCausalLM" else None)
        return [_checked(window)] * num_layers
    if architecture == "Qwen3MoeForCausalLM":  # every layer, when use_sliding_window
        window = (hf_config.get("sliding_window", DEFAULT_WINDOW)
                  if hf_config.get("use_sliding_window") else None)
        return [_checked(window)] * num_layers
    if architecture not in QWEN_DEFAULT_MAX_WINDOW_LAYERS:
        return [None] * num_layers  # Llama: transformers reads none of these fields
    # transformers drops the window unless use_sliding_window is set.
    window = (hf_config.get("sliding_window", DEFAULT_WINDOW)
              if hf_config.get("use_sliding_window") else None)
    layer_types = hf_config.get("layer_types")
    if layer_types is None and architecture == "Qwen2MoeForCausalLM":
        # transformers 5's Qwen2MoeConfig: the even-numbered layers below max_window_layers.
        last = int(hf_config.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if window is not None and i % 2 == 0 and i < last
                       else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        first = int(hf_config.get("max_window_layers",
                                  QWEN_DEFAULT_MAX_WINDOW_LAYERS[architecture]))
        layer_types = ["sliding_attention" if window is not None and i >= first
                       else "full_attention" for i in range(num_layers)]
    return _by_kind(layer_types, window, num_layers)


def _by_kind(layer_types: list[str], window: Any, num_layers: int) -> list[int | None]:
    unknown = sorted({t for t in layer_types if t not in LAYER_KINDS})
    if unknown:
        raise ValueError(f"layer_types {unknown} is not supported: raylm knows the layer kinds "
                         f"{list(LAYER_KINDS)}.")
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for "
                         f"num_hidden_layers={num_layers}.")
    # A "sliding_attention" layer without a window attends to every earlier key.
    return [_checked(window) if kind == "sliding_attention" and window is not None else None
            for kind in layer_types]


def _checked(window: Any) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}.")
    return window


def check_attention_layout(architecture: str, hf_config: dict[str, Any]) -> None:
    """ValueError naming the field when the checkpoint asks for a layer raylm cannot run."""
    layer_windows(architecture, hf_config)
