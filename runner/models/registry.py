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


# Diffusion language models: their own passes (encode, denoise), not a causal LM's forward
# (docs/architecture.md §23); loaded by runner/loading/diffusion_loader.py.
DIFFUSION_MODELS = {"DiffusionGemmaForBlockDiffusion":
                    ("raylm.runner.models.diffusion_gemma", "DiffusionGemmaForBlockDiffusion")}


def get_diffusion_model_class(architectures: list[str]) -> type[nn.Module]:
    arch = next((a for a in architectures if a in DIFFUSION_MODELS), None)
    if arch is None:
        raise ValueError(f"architecture {architectures!r} is not a supported diffusion "
                         f"model; supported: {list(DIFFUSION_MODELS)}.")
    module, name = DIFFUSION_MODELS[arch]
    return getattr(importlib.import_module(module), name)
