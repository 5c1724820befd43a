"""Act-order GPTQ weights (``desc_act``): each input feature's group comes from ``g_idx``,
so a group's features are scattered over the input dimension instead of forming a run.

The shard keeps the checkpoint's column order while the TP loaders narrow it (a
row-parallel rank takes any range of input features), and only the packer sorts it
(``to_group``): this shard's features stably sorted by group, each group's run padded with
zero columns to a multiple of 32, so every group of 32 has one scale and zero and the
kernel runs it unchanged. The sorted order travels with the weight (``input_order``):
the linear gathers x's features into it, a padding column reading a zero (vLLM's
act-order kernels permute the activations the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.runner.quantization.group_quantized import GROUP_SIZE, GroupQuantized


@dataclass(frozen=True)
class ActOrderQuantized:
    """``codes`` [N, K] uint8 (4-bit), ``g_idx`` [K] int64, ``scale`` and ``zero`` [N,
    groups] float32 with w[n, k] = scale[n, g] * code[n, k] + zero[n, g], g = g_idx[k]."""

    codes: torch.Tensor
    g_idx: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int = 4
    kind: str = "GPTQ"

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if tuple(self.g_idx.shape) != (k,):
            raise ValueError(f"{self.kind} g_idx has shape {tuple(self.g_idx.shape)}, the "
                             f"weight {k} input features.")
        groups = self.scale.shape[1]
        if k and not 0 <= int(self.g_idx.min()) <= int(self.g_idx.max()) < groups:
            raise ValueError(f"{self.kind} g_idx names groups outside [0, {groups}).")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def narrow(self, dim: int, start: int, length: int) -> ActOrderQuantized:
        if dim == 0:
            return ActOrderQuantized(self.codes.narrow(0, start, length), self.g_idx,
                                     self.scale.narrow(0, start, length),
                                     self.zero.narrow(0, start, length), self.bits, self.kind)
        return ActOrderQuantized(self.codes.narrow(1, start, length),
                                 self.g_idx.narrow(0, start, length), self.scale, self.zero,
                                 self.bits, self.kind)

    def pad_rows(self, rows: int) -> ActOrderQuantized:
        extra = rows - self.codes.shape[0]
        if extra <= 0:
            return self
        return ActOrderQuantized(
            torch.cat([self.codes, self.codes.new_zeros(extra, self.shape[1])]), self.g_idx,
            torch.cat([self.scale, self.scale.new_zeros(extra, self.scale.shape[1])]),
            torch.cat([self.zero, self.zero.new_zeros(extra, self.zero.shape[1])]),
            self.bits, self.kind)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = (self.codes.float() * self.scale[:, self.g_idx]) + self.zero[:, self.g_idx]
        return w.to(dtype)

    def to_group(self) -> GroupQuantized:
        """Features sorted by group, each group's run padded to a multiple of 32 with zero
        columns; ``input_order`` [K'] names each column's feature (-1: a padding column)."""
        n, k = self.codes.shape
        order = torch.argsort(self.g_idx, stable=True)
        groups, counts = torch.unique_consecutive(self.g_idx[order], return_counts=True)
        columns, chunk_groups = [], []
        start = 0
        for g, count in zip(groups.tolist(), counts.tolist(), strict=True):
            padded = -(-count // GROUP_SIZE) * GROUP_SIZE
            run = torch.full((padded,), -1, dtype=torch.int64)
            run[:count] = order[start:start + count]
            columns.append(run)
            chunk_groups += [g] * (padded // GROUP_SIZE)
            start += count
        input_order = torch.cat(columns) if columns else torch.zeros(0, dtype=torch.int64)
        # Column -1 of the codes padded by one zero column: a padding column's codes are 0.
        codes = torch.cat([self.codes, self.codes.new_zeros(n, 1)], dim=1)[:, input_order]
        index = torch.tensor(chunk_groups, dtype=torch.int64)
        return GroupQuantized(codes.contiguous(), self.scale[:, index].contiguous(),
                              self.zero[:, index].contiguous(), self.bits, self.kind,
                              input_order=input_order)


class InputOrder:
    """A packed act-order weight's column order on the kernel's device: x's features are
    gathered into it (a padding column reads the zero appended to x), and a dequantized
    weight is put back into the features' order."""

    def __init__(self, order: torch.Tensor, device: torch.device | str) -> None:
        self.width = int((order >= 0).sum())  # the layer's input features
        self.index = torch.where(order < 0, self.width, order).to(device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, 1)).index_select(1, self.index)

    def unpermute(self, w: torch.Tensor) -> torch.Tensor:
        """w [N, K'] in the packed order -> [N, width], the padding columns dropped."""
        real = self.index < self.width
        out = w.new_zeros((w.shape[0], self.width))
        out[:, self.index[real]] = w[:, real]
        return out
