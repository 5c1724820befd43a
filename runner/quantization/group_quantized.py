"""A weight as integer codes with a scale and a zero per group of input features (w = scale
* code + zero): what GGUF's blocks, GPTQ and AWQ decode to, before the kernel's repacking
(packed_linear.py). A group is 32 features, or 16 for Q6_K (an int8 scale per 16 weights:
two scales in a group of 32 have no exact common form with 8-bit codes).

It narrows like a checkpoint tensor (the TP weight loaders take rows of a column-parallel
weight, whole groups of columns of a row-parallel one), so each rank keeps only its shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32  # the kernels' step along K: a column range is cut at multiples of it
GROUP_SIZES = (16, 32)


@dataclass(frozen=True)
class GroupQuantized:
    """``codes`` [N, K] (uint8 0..15 for 4 bits, int8 for 8), ``scale`` and ``zero``
    [N, K / group_size] float32; ``kind`` is the checkpoint's type name (for logs and
    errors). K is a multiple of 32 whatever the group size.
    ``input_order`` [K] (act-order GPTQ, act_order.py): the input feature each column
    reads, -1 for a padding column (it reads a zero); None: column k is feature k."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    kind: str
    input_order: torch.Tensor | None = None
    group_size: int = GROUP_SIZE

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"{self.kind} group_size={self.group_size}; the kernels take "
                             f"{GROUP_SIZES}.")
        if k % GROUP_SIZE or tuple(self.scale.shape) != (n, k // self.group_size) \
                or self.scale.shape != self.zero.shape:
            raise ValueError(f"{self.kind} weight of shape {(n, k)}: scales "
                             f"{tuple(self.scale.shape)} do not cover groups of "
                             f"{self.group_size}.")
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
                                  self.input_order, self.group_size)
        if self.input_order is not None:
            raise ValueError(f"a {self.kind} weight in act order is narrowed before sorting.")
        if start % GROUP_SIZE or length % GROUP_SIZE:
            raise ValueError(f"a {self.kind} weight splits its input features in groups of "
                             f"{GROUP_SIZE}; columns [{start}, {start + length}) cut one.")
        g0, g = start // self.group_size, length // self.group_size
        return GroupQuantized(self.codes.narrow(1, start, length),
                              self.scale.narrow(1, g0, g), self.zero.narrow(1, g0, g),
                              self.bits, self.kind, group_size=self.group_size)

    def pad_rows(self, rows: int) -> GroupQuantized:
        """Zero rows (scale and zero 0: they decode to 0.0) appended up to ``rows``."""
        extra = rows - self.codes.shape[0]
        if extra <= 0:
            return self
        return GroupQuantized(torch.cat([self.codes, self.codes.new_zeros(extra, self.shape[1])]),
                              torch.cat([self.scale, self.scale.new_zeros(extra, self.scale.shape[1])]),
                              torch.cat([self.zero, self.zero.new_zeros(extra, self.zero.shape[1])]),
                              self.bits, self.kind, group_size=self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K]: scale * code + zero in float32, then ``dtype``."""
        n, k = self.codes.shape
        codes = self.codes.float().reshape(n, k // self.group_size, self.group_size)
        w = codes * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)
        return w.reshape(n, k).to(dtype)

    def regrouped(self, group_size: int) -> GroupQuantized:
        """The same weight with each scale and zero repeated over smaller groups (exact)."""
        if group_size == self.group_size:
            return self
        if self.group_size % group_size:
            raise ValueError(f"{self.kind} groups of {self.group_size} do not split into "
                             f"groups of {group_size}.")
        r = self.group_size // group_size
        return GroupQuantized(self.codes, self.scale.repeat_interleave(r, dim=1),
                              self.zero.repeat_interleave(r, dim=1), self.bits, self.kind,
                              self.input_order, group_size)

    def widened(self, bits: int) -> GroupQuantized:
        """The same weight with ``bits``-bit codes (exact: 4-bit codes 0..15 are int8 codes
        too), so that it stacks with parts of that width."""
        if bits == self.bits:
            return self
        if (self.bits, bits) != (4, 8):
            raise ValueError(f"{self.kind} {self.bits}-bit codes do not widen to {bits} bits.")
        return GroupQuantized(self.codes.to(torch.int8), self.scale, self.zero, 8, self.kind,
                              self.input_order, self.group_size)


def concat_rows(parts: list[GroupQuantized]) -> GroupQuantized:
    """Row blocks stacked (a merged q/k/v or gate/up weight). Parts with different groups
    (Q8_0's 32 beside Q6_K's 16) all take the smallest; 4-bit parts beside 8-bit ones (a
    Q4_K_M file's Q4_K q/k beside its Q6_K v) all take 8 bits."""
    group = min(p.group_size for p in parts)
    bits = max(p.bits for p in parts)
    parts = [p.regrouped(group).widened(bits) for p in parts]
    order = parts[0].input_order
    for p in parts[1:]:
        other = p.input_order
        if (other is None) != (order is None) or (
                other is not None and order is not None and not torch.equal(other, order)):
            raise ValueError("a merged weight's parts order their input features differently.")
    return GroupQuantized(torch.cat([p.codes for p in parts]),
                          torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), parts[0].bits,
                          "+".join(sorted({p.kind for p in parts})), order, group)
