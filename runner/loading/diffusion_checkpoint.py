"""Tiny random DiffusionGemma checkpoints written through transformers' own class (tests
and benchmarks; nothing downloaded): the layers of both passes, sliding and global, experts
beside the dense MLP, layer norms and scalars moved off their defaults so that a wrong one
shows, and optionally a trained tokenizer and the denoising loop's generation config."""

from __future__ import annotations

import json
import os
from typing import Any


def write_random_diffusion_checkpoint(path: str, canvas_length: int = 4,
                                      sliding_window: int = 32, vocab_size: int = 96,
                                      eos_token_id: int = 3, with_tokenizer: bool = False,
                                      hidden_size: int = 32, num_hidden_layers: int = 4,
                                      seed: int = 0,
                                      generation: dict[str, Any] | None = None) -> str:
    """Write the checkpoint into ``path``. ``with_tokenizer``: a byte-level BPE of
    ``vocab_size`` (its ``</s>`` is the EOS); ``generation``: fields of
    ``generation_config.json`` (``max_denoising_steps``, ``t_min``, ...)."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from raylm.runner.loading.checkpoint import train_tokenizer

    os.makedirs(path, exist_ok=True)
    tokenizer = None
    if with_tokenizer:
        tokenizer = train_tokenizer(vocab_size, seed)
        eos_token_id = tokenizer.eos_token_id
    kinds = ("sliding_attention", "full_attention")
    text = dict(vocab_size=vocab_size, hidden_size=hidden_size,
                intermediate_size=hidden_size * 3 // 2, num_hidden_layers=num_hidden_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
                global_head_dim=hidden_size // 2, num_global_key_value_heads=1,
                sliding_window=sliding_window, num_experts=4, top_k_experts=2,
                moe_intermediate_size=hidden_size // 2, max_position_embeddings=256,
                eos_token_id=eos_token_id, initializer_range=0.3,
                layer_types=[kinds[i % 2] for i in range(num_hidden_layers)])
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=8)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(
        text_config=text, vision_config=vision, canvas_length=canvas_length,
        initializer_range=0.3))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:  # not all ones: a wrong norm shows
                p.add_(torch.rand(p.shape, generator=g) * 0.5 - 0.25)
        # The encoder's layer scalars are its own (not tied): make them differ.
        for i, layer in enumerate(model.model.encoder.language_model.layers):
            layer.layer_scalar.fill_(0.8 + 0.1 * i)
        for i, layer in enumerate(model.model.decoder.layers):
            layer.layer_scalar.fill_(1.2 - 0.1 * i)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if generation:
        config_path = os.path.join(path, "generation_config.json")
        with open(config_path) as f:
            config = json.load(f)
        config.update(generation)
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
    return path
