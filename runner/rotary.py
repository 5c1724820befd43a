"""Rotary position embedding (HF "rotate_half" layout) with a precomputed cos/sin cache.

Default RoPE is computed here; every other ``rope_type`` (linear, dynamic, yarn, llama3,
longrope) takes its inverse frequencies and attention scaling from transformers'
``ROPE_INIT_FUNCTIONS``, so the numbers are the reference implementation's. Dynamic-NTK
and longrope switch frequencies on sequence length in HF; here the frequencies for
``max_position_embeddings`` are used throughout (the same as HF below that length).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylm.scheduler.config.rope_params import rope_parameters


def compute_inv_freq(hf_config: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotated channels / 2] float32, attention_scaling applied to cos and
    sin)."""
    params = rope_parameters(hf_config)
    factor = float(params.get("partial_rotary_factor",
                              hf_config.get("partial_rotary_factor", 1.0)))
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}.")
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = int(head_dim * factor)  # the rotated leading channels of each head
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        return 1.0 / (base ** exponent), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; "
                         f"known: {['default', *ROPE_INIT_FUNCTIONS]}.")
    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures")}
    fields.setdefault("head_dim", head_dim)
    fields.setdefault("partial_rotary_factor", factor)
    config = AutoConfig.for_model(hf_config.get("model_type", "llama"), **fields)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    # Buffers (register_buffer), declared for the type checker.
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, hf_config: dict[str, Any], head_dim: int, max_position: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        # As HF: angles in float32, cos/sin scaled, then cast to the activation dtype.
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(dtype=dtype, device=device),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, R] (R: the rotated channels, D or fewer) for ``positions`` [T]; looked up once per forward and
        shared by every layer."""
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        return cos, sin
