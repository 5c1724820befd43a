"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

from raylm.scheduler.config.engine_config import SUPPORTED_ARCHITECTURES, supported_architecture

# Every supported architecture is a Llama-family decoder; DecoderConfig sets the
# per-architecture flags (Qwen2's qkv bias, Qwen3's q/k norm).
_MODELS = {arch: ("raylm.runner.models.llama", "LlamaForCausalLM")
           for arch in SUPPORTED_ARCHITECTURES}


def resolve_architecture(architectures: list[str]) -> str:
    return supported_architecture(architectures)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    # nn.Module, not the Llama class: llama.py imports decoder_config, which imports this.
    module, name = _MODELS[resolve_architecture(architectures)]
    return getattr(importlib.import_module(module), name)
