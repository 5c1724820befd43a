"""A safetensors checkpoint's quantized linear (GPTQ, AWQ, FP8) not read yet: the TP weight
loaders narrow it like a tensor (rows of a column-parallel weight, input features of a
row-parallel one), and only when its layer is packed does ``decode`` read the part of each
packed tensor that the rank keeps (safetensors ``get_slice``), so a rank reads about 1/TP of
the packed data. A narrow that cuts what the format cannot split (a packed int32, a group
of the kernel's, an FP8 scale block) is refused by name before anything is read.

``Dequantizing`` shows one to the loaders as a lazy dense tensor (``quantization="none"``):
each narrow reads and dequantizes only its part.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch

from raylm.runner.quantization.act_order import ActOrderQuantized
from raylm.runner.quantization.fp8_weight import Fp8Weight
from raylm.runner.quantization.gguf_blocks import LazyGGUFBlocks
from raylm.runner.quantization.group_quantized import GroupQuantized

Decoded = GroupQuantized | ActOrderQuantized | Fp8Weight


class Region(Protocol):
    """What a shard reads from: a ``LazyTensor`` (runner/loading/model_loader.py)."""

    shape: torch.Size

    def region(self, *ranges: tuple[int, int]) -> torch.Tensor: ...


def read_region(tensor: torch.Tensor | Region, *ranges: tuple[int, int]) -> torch.Tensor:
    """Indices ``start..stop`` of each leading dim (the rest whole): from the file alone for
    a lazy tensor, a copy for one already read."""
    if isinstance(tensor, torch.Tensor):
        index = tuple(slice(a, b) for a, b in ranges)
        return tensor[index].contiguous()
    return tensor.region(*ranges)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class LazyQuantizedShard:
    """A quantized [N, K] linear weight; ``rows`` and ``columns`` the (start, stop) ranges
    of the file's weight the loaders kept. Subclasses read and decode them (``decode``) and
    name the run of input features a narrow must keep whole (``column_unit``, the last run
    of a row may be short; ``column_rule`` says why)."""

    kind: str = "quantized"
    bits: int = 4
    column_unit: int = 1
    column_rule: str = ""

    def __init__(self, name: str, shape: tuple[int, int]) -> None:
        self.name = name
        self.file_shape = shape
        self.rows = (0, shape[0])
        self.columns = (0, shape[1])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows[1] - self.rows[0], self.columns[1] - self.columns[0]))

    def narrow(self, dim: int, start: int, length: int) -> Any:
        if dim not in (-2, -1, 0, 1):
            raise IndexError(f"{self.name}: dim {dim} is out of range for a 2-D weight.")
        dim %= 2
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"{self.name}: [{start}, {start + length}) of dim {dim} is "
                             f"outside its shape {tuple(self.shape)}.")
        out = copy.copy(self)
        if dim == 0:
            out.rows = (self.rows[0] + start, self.rows[0] + start + length)
            return out
        first, stop = self.columns[0] + start, self.columns[0] + start + length
        if (first, stop) != self.covering_columns(first, stop):
            raise ValueError(f"{self.name}: the {self.kind} weight {self.column_rule}; input "
                             f"features [{first}, {stop}) cut one (a TP split must give each "
                             f"rank whole runs of {self.column_unit}).")
        out.columns = (first, stop)
        return out

    def covering_columns(self, start: int, stop: int) -> tuple[int, int]:
        """The smallest range of whole runs of ``column_unit`` holding [start, stop)."""
        unit = self.column_unit
        return start // unit * unit, min(ceil_div(stop, unit) * unit, self.file_shape[1])

    def decode(self) -> Decoded:
        raise NotImplementedError

    def pad_rows(self, rows: int) -> Decoded:
        return self.decode().pad_rows(rows)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.decode().dequantize(dtype)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, rows={self.rows}, "
                f"columns={self.columns})")


class Dequantizing:
    """A lazy quantized shard (a GPTQ/AWQ/FP8 linear, or a GGUF tensor's blocks) as a lazy
    dense tensor (parallel/layers.py ``LazyWeight``): a narrow reads the whole runs of
    input features it touches, dequantized, so a dense load takes any TP split."""

    def __init__(self, shard: LazyQuantizedShard | LazyGGUFBlocks) -> None:
        self._shard = shard
        self.shape = shard.shape

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        shard = self._shard
        if dim % 2 == 0:
            return shard.narrow(0, start, length).dequantize()
        first = shard.columns[0] + start
        a, b = shard.covering_columns(first, first + length)
        wide = shard.narrow(1, a - shard.columns[0], b - a).dequantize()
        return wide.narrow(1, first - a, length).contiguous()

    def read(self) -> torch.Tensor:
        return self._shard.dequantize()
