"""A GPTQ or AWQ linear (layouts in gptq_awq.py) read per TP rank: only the packed rows and
columns of ``qweight``, ``qzeros``, ``scales`` and ``g_idx`` that hold the rank's output
features and input features, decoded into codes with a scale and zero per group of 32.

Output features (a column-parallel rank's rows) may start anywhere: the int32 columns that
pack eight of them are read whole and the unpacked codes cut. Input features (a row-parallel
rank's columns) go in runs of 32, the kernels' group: a checkpoint group of 128 is four of
them with one scale, so a rank may start inside a checkpoint group (both ranks then read its
one scale row). Act-order GPTQ: the rank's slice of ``g_idx`` names its groups, and only
the scale rows from the least to the greatest of them are read.
"""

from __future__ import annotations

from typing import Any

import torch

from raylm.runner.quantization.act_order import ActOrderQuantized
from raylm.runner.quantization.group_quantized import GROUP_SIZE, GroupQuantized
from raylm.runner.quantization.lazy_shard import LazyQuantizedShard, ceil_div, read_region

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = 8  # 4-bit values per int32


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [8 R, C]: row 8i+j from bits 4j of row i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)
    return ((packed.unsqueeze(1) >> shifts) & 15).reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> [R, 8 C]: column 8i + order[j] from bits 4j of column i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 1, 8)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 15  # [R, C, 8], nibble j
    if order is not None:
        inverse = [0] * 8
        for j, column in enumerate(order):
            inverse[column] = j
        nibbles = nibbles[..., inverse]
    return nibbles.reshape(packed.shape[0], -1)


def to_groups_of_32(codes_kn: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int, kind: str, first: int = 0) -> GroupQuantized:
    """codes [K, N] and the zeros and scales [groups, N] of the checkpoint groups they fall
    in, the first feature ``first`` features into its group -> GroupQuantized [N, K] in
    groups of 32 (zero' = -scale * zero, exact)."""
    if group_size % GROUP_SIZE:
        raise ValueError(f"{kind} group_size={group_size} is not a multiple of {GROUP_SIZE}.")
    repeat = group_size // GROUP_SIZE
    g0, g = first // GROUP_SIZE, codes_kn.shape[0] // GROUP_SIZE
    scale = scales.float().repeat_interleave(repeat, dim=0)[g0:g0 + g]  # [K/32, N]
    zero = -scale * zeros.float().repeat_interleave(repeat, dim=0)[g0:g0 + g]
    return GroupQuantized(codes_kn.t().to(torch.uint8).contiguous(), scale.t().contiguous(),
                          zero.t().contiguous(), 4, kind)


class GptqAwqShard(LazyQuantizedShard):
    """``parts``: the linear's ``qweight``, ``qzeros``, ``scales`` (and GPTQ's optional
    ``g_idx``), each a LazyTensor or a tensor; ``v1_zeros``: GPTQ's original format,
    zeros stored minus one."""

    bits = 4
    column_unit = GROUP_SIZE
    column_rule = f"splits its input features in the kernels' groups of {GROUP_SIZE}"

    def __init__(self, name: str, method: str, parts: dict[str, Any], group_size: int,
                 v1_zeros: bool) -> None:
        qweight = parts["qweight"]
        if method == "gptq":
            shape = (int(qweight.shape[1]), int(qweight.shape[0]) * PACK)
        else:
            shape = (int(qweight.shape[1]) * PACK, int(qweight.shape[0]))
        super().__init__(name, shape)
        self.kind = method.upper()
        self.method, self.parts = method, parts
        self.group_size, self.v1_zeros = group_size, v1_zeros

    def _packed_columns(self, tensor: Any, rows: tuple[int, int], order: tuple[int, ...] | None
                        ) -> torch.Tensor:
        """``tensor``'s rows ``rows`` with output features packed eight per int32 column:
        the columns holding this shard's features, unpacked and cut to them."""
        n0, n1 = self.rows
        c0, c1 = n0 // PACK, ceil_div(n1, PACK)
        values = unpack_columns(read_region(tensor, rows, (c0, c1)), order)
        return values[:, n0 - c0 * PACK:n1 - c0 * PACK]

    def decode(self) -> GroupQuantized | ActOrderQuantized:
        """Read this shard's part of each packed tensor and decode it."""
        (n0, n1), (k0, k1) = self.rows, self.columns
        size = self.group_size
        g0, g1 = k0 // size, ceil_div(k1, size)  # the checkpoint groups the features touch
        if self.method == "awq":
            codes = self._packed_columns(self.parts["qweight"], (k0, k1), AWQ_ORDER)
            zeros = self._packed_columns(self.parts["qzeros"], (g0, g1), AWQ_ORDER)
            scales = read_region(self.parts["scales"], (g0, g1), (n0, n1))
            return to_groups_of_32(codes, zeros, scales, size, self.kind, k0 - g0 * size)
        codes = unpack_rows(read_region(self.parts["qweight"], (k0 // PACK, k1 // PACK),
                                        (n0, n1)))  # [K, N]
        g_idx, order = self.parts.get("g_idx"), None
        if g_idx is not None:
            index = read_region(g_idx, (k0, k1)).long()
            if not torch.equal(index, torch.arange(k0, k1) // size):
                order = index  # act order: the groups are not runs of features
                g0, g1 = int(index.min()), int(index.max()) + 1
        zeros = self._packed_columns(self.parts["qzeros"], (g0, g1), None)
        zeros = zeros + (1 if self.v1_zeros else 0)
        scales = read_region(self.parts["scales"], (g0, g1), (n0, n1))
        if order is None:
            return to_groups_of_32(codes, zeros, scales, size, self.kind, k0 - g0 * size)
        scale = scales.float().t().contiguous()  # [N, groups]
        return ActOrderQuantized(codes.t().to(torch.uint8).contiguous(), order - g0, scale,
                                 (-scale * zeros.float().t()).contiguous())
