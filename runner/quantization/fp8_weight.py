"""An FP8 (float8_e4m3fn) weight kept in its bytes, with a float32 scale per output feature
and group of input features: w[n, k] = float(code[n, k]) * scale[n, k // group].

Every FP8 layout raylm reads maps onto it exactly (fp8_checkpoint.py): block-wise [bn, bk]
(DeepSeek-V3) as each row's scales per group of bk (the block row's scales repeated over
its bn rows: 4 bytes per bk weights); per-channel and per-tensor as one group spanning the
row. It narrows like a checkpoint tensor (rows for a column-parallel weight, whole groups
of columns for a row-parallel one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Weight:
    """``codes`` [N, K] float8_e4m3fn, ``scale`` [N, ceil(K / group)] float32."""

    codes: torch.Tensor
    scale: torch.Tensor
    group: int
    kind: str = "FP8"

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{self.kind} weight dtype is {self.codes.dtype}; float8_e4m3fn "
                             "is read.")
        if self.group <= 0 or tuple(self.scale.shape) != (n, -(-k // self.group)):
            raise ValueError(f"{self.kind} weight of shape {(n, k)}: scales "
                             f"{tuple(self.scale.shape)} do not cover groups of {self.group}.")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def bits(self) -> int:
        return 8

    def narrow(self, dim: int, start: int, length: int) -> Fp8Weight:
        if dim == 0:
            return Fp8Weight(self.codes.narrow(0, start, length),
                             self.scale.narrow(0, start, length), self.group, self.kind)
        k = self.codes.shape[1]
        if self.scale.shape[1] == 1:  # one scale a row: any range of columns keeps it
            return Fp8Weight(self.codes.narrow(1, start, length), self.scale,
                             max(length, 1), self.kind)
        if start % self.group or (length % self.group and start + length != k):
            raise ValueError(f"an {self.kind} weight scales its input features in groups of "
                             f"{self.group}; columns [{start}, {start + length}) cut one.")
        g0, g1 = start // self.group, -(-(start + length) // self.group)
        return Fp8Weight(self.codes.narrow(1, start, length),
                         self.scale.narrow(1, g0, g1 - g0), self.group, self.kind)

    def pad_rows(self, rows: int) -> Fp8Weight:
        """Zero rows (scale 0) appended up to ``rows``."""
        extra = rows - self.codes.shape[0]
        if extra <= 0:
            return self
        codes = torch.cat([self.codes.view(torch.uint8),
                           self.codes.new_zeros(extra, self.shape[1]).view(torch.uint8)])
        return Fp8Weight(codes.view(torch.float8_e4m3fn),
                         torch.cat([self.scale, self.scale.new_zeros(extra, self.scale.shape[1])]),
                         self.group, self.kind)

    def expanded_scale(self) -> torch.Tensor:
        """[N, K] float32: each weight's scale."""
        k = self.codes.shape[1]
        return self.scale.repeat_interleave(self.group, dim=1)[:, :k]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K]: code * scale in float32, then ``dtype``."""
        return (self.codes.float() * self.expanded_scale()).to(dtype)


def concat_fp8_rows(parts: list[Fp8Weight]) -> Fp8Weight:
    """Row blocks stacked (a merged q/k/v or gate/up); parts with different groups (a
    per-channel beside a block-wise layer) take the groups' greatest common divisor, their
    scales repeated (exact)."""
    k = parts[0].shape[1]
    group = math.gcd(*(min(p.group, k) for p in parts))
    scales = [p.scale if min(p.group, k) == group else
              p.expanded_scale()[:, ::group].contiguous() for p in parts]
    codes = torch.cat([p.codes.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
    return Fp8Weight(codes, torch.cat(scales), group, "+".join(sorted({p.kind for p in parts})))
