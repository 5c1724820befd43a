"""A weight as integer codes with a scale and a zero per group of 32 input features
(w = scale * code + zero): what GGUF's Q4_0, Q4_1, Q4_K and Q8_0 blocks decode to,
before the kernel's repacking (packed_linear.py).

It narrows like a checkpoint tensor (the TP weight loaders take rows of a column-parallel
weight, whole groups of columns of a row-parallel one), so each rank keeps only its shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32


@dataclass(frozen=True)
class GroupQuantized:
    """``codes`` [N, K] (uint8 0..15 for 4 bits, int8 for 8), ``scale`` and ``zero``
    [N, K / 32] float32; ``kind`` is the checkpoint's type name (for logs and errors).
    ``input_order`` [K] (act-order GPTQ, act_order.py): the input feature each column
    reads, -1 for a padding column (it reads a zero); None: column k is feature k."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    kind: str
    input_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if k % GROUP_SIZE or tuple(self.scale.shape) != (n, k // GROUP_SIZE) \
                or self.scale.shape != self.zero.shape:
            raise ValueError(f"{self.kind} weight of shape {(n, k)}: scales "
                             f"{tuple(self.scale.shape)} do not cover groups of {GROUP_SIZE}.")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}.")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def narrow(self, dim: int, start: int, length: int) -> GroupQuantized:
        if dim == 0:
            return GroupQuantized(self.codes.narrow(0, start, length),
                                  self.scale.narrow(0, start, length),
                                  self.zero.narrow(0, start, length), self.bits, self.kind,
                                  self.input_order)
        if self.input_order is not None:
            raise ValueError(f"a {self.kind} weight in act order is narrowed before sorting.")
        if start % GROUP_SIZE or length % GROUP_SIZE:
            raise ValueError(f"a {self.kind} weight splits its input features in groups of "
                             f"{GROUP_SIZE}; columns [{start}, {start + length}) cut one.")
        g0, g = start // GROUP_SIZE, length // GROUP_SIZE
        return GroupQuantized(self.codes.narrow(1, start, length),
                              self.scale.narrow(1, g0, g), self.zero.narrow(1, g0, g),
                              self.bits, self.kind)

    def pad_rows(self, rows: int) -> GroupQuantized:
        """Zero rows (scale and zero 0: they decode to 0.0) appended up to ``rows``."""
        extra = rows - self.codes.shape[0]
        if extra <= 0:
            return self
        return GroupQuantized(torch.cat([self.codes, self.codes.new_zeros(extra, self.shape[1])]),
                              torch.cat([self.scale, self.scale.new_zeros(extra, self.scale.shape[1])]),
                              torch.cat([self.zero, self.zero.new_zeros(extra, self.zero.shape[1])]),
                              self.bits, self.kind)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K]: scale * code + zero in float32, then ``dtype``."""
        n, k = self.codes.shape
        codes = self.codes.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        w = codes * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)
        return w.reshape(n, k).to(dtype)


def concat_rows(parts: list[GroupQuantized]) -> GroupQuantized:
    """Row blocks stacked (a merged q/k/v or gate/up weight); they must agree on bits."""
    if len({p.bits for p in parts}) != 1:
        raise ValueError(f"a merged weight mixes {sorted(p.kind for p in parts)}.")
    order = parts[0].input_order
    for p in parts[1:]:
        other = p.input_order
        if (other is None) != (order is None) or (
                other is not None and order is not None and not torch.equal(other, order)):
            raise ValueError("a merged weight's parts order their input features differently.")
    return GroupQuantized(torch.cat([p.codes for p in parts]),
                          torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), parts[0].bits,
                          "+".join(sorted({p.kind for p in parts})), order)
