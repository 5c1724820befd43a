"""A gated delta net mixer's shape (Qwen3-Next's linear attention layers), read from
config.json as transformers' Qwen3NextConfig reads it, and its split over tensor
parallelism: rank r holds key heads ``[r * nk / tp, (r + 1) * nk / tp)`` and the value
heads they serve, which the checkpoint's projections keep together (grouped per key
head), so each rank's slice is one contiguous block. A TP size that does not divide
``linear_num_key_heads`` is refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GatedDeltaShape:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float
    chunk_size: int = 64  # transformers' torch chunk

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GatedDeltaShape:
        nk = int(hf.get("linear_num_key_heads", 16))
        nv = int(hf.get("linear_num_value_heads", 32))
        if nk < 1 or nv % nk:
            raise ValueError(f"linear_num_value_heads {nv} must be a multiple of "
                             f"linear_num_key_heads {nk}.")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported for gated delta net "
                             "layers (only 'silu').")
        return cls(num_k_heads=nk, num_v_heads=nv,
                   head_k_dim=int(hf.get("linear_key_head_dim", 128)),
                   head_v_dim=int(hf.get("linear_value_head_dim", 128)),
                   conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
                   norm_eps=float(hf.get("rms_norm_eps", 1e-6)))

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def check_tp(self, tp_size: int) -> None:
        if self.num_k_heads % tp_size:
            raise ValueError(f"linear_num_key_heads={self.num_k_heads} is not divisible by "
                             f"tensor_parallel_size={tp_size}: each rank holds whole key "
                             "heads and the value heads they serve.")

    def per_rank(self, tp_size: int) -> GatedDeltaShape:
        self.check_tp(tp_size)
        return GatedDeltaShape(self.num_k_heads // tp_size, self.num_v_heads // tp_size,
                               self.head_k_dim, self.head_v_dim, self.conv_kernel,
                               self.norm_eps, self.chunk_size)
