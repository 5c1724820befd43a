"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

# Qwen2 (qkv bias) and Qwen3 (q/k norm) are Llama with flags; DecoderConfig sets them.
_MODELS = {
    "LlamaForCausalLM": ("raylm.runner.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("raylm.runner.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("raylm.runner.models.llama", "LlamaForCausalLM"),
}


def resolve_architecture(architectures: list[str]) -> str:
    for arch in architectures:
        if arch in _MODELS:
            return arch
    raise ValueError(f"architecture {architectures!r} is not supported; "
                     f"supported: {sorted(_MODELS)}.")


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    import importlib

    module, name = _MODELS[resolve_architecture(architectures)]
    return getattr(importlib.import_module(module), name)
