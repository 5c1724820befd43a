"""An FP8 linear (layouts in fp8_checkpoint.py) read per TP rank: only the rank's rows and
columns of the float8_e4m3fn ``weight`` and the scales that cover them, as an Fp8Weight
(fp8_weight.py).

Rows (a column-parallel rank) may start anywhere: a block-wise scale's block rows that the
rows touch are read and repeated over them. Columns (a row-parallel rank) must be whole
blocks of a block-wise layout (a block's one scale cannot be split between ranks; the last
block of a row may be short); per-tensor and per-channel scales take any columns.
"""

from __future__ import annotations

from typing import Any

import torch

from raylm.runner.quantization.fp8_weight import Fp8Weight
from raylm.runner.quantization.lazy_shard import LazyQuantizedShard, ceil_div, read_region


class Fp8Shard(LazyQuantizedShard):
    """``weight`` [N, K] and its checkpoint ``scale`` (LazyTensors or tensors): per block
    [ceil(N/bn), ceil(K/bk)] when ``block`` is (bn, bk), else one per tensor or per output
    channel ([N] or [N, 1]), told apart by the header's shape."""

    kind = "FP8"
    bits = 8

    def __init__(self, name: str, weight: Any, scale: Any, block: tuple[int, int] | None
                 ) -> None:
        n, k = (int(d) for d in weight.shape)
        super().__init__(name, (n, k))
        self.weight, self.scale, self.block = weight, scale, block
        shape = tuple(int(d) for d in scale.shape)
        if block is not None:
            bn, bk = block
            want = (ceil_div(n, bn), ceil_div(k, bk))
            if shape != want:
                raise ValueError(f"{name}: scale shape {shape} for a [{n}, {k}] weight in "
                                 f"blocks of {list(block)}; expected {want}.")
            self.column_unit = bk
            self.column_rule = f"scales its input features in blocks of {bk}"
            self.layout = "block"
        elif torch.Size(shape).numel() == 1:
            self.layout = "tensor"
        elif shape in ((n,), (n, 1)):
            self.layout = "channel"
        else:
            raise ValueError(f"{name}: scale shape {shape} is neither per tensor nor per "
                             f"channel of a [{n}, {k}] weight (and the checkpoint names no "
                             "block).")

    def decode(self) -> Fp8Weight:
        """Read this shard's bytes and scales."""
        (n0, n1), (k0, k1) = self.rows, self.columns
        n, k = n1 - n0, k1 - k0
        codes = read_region(self.weight, (n0, n1), (k0, k1))
        if self.block is not None:
            bn, bk = self.block
            r0 = n0 // bn
            blocks = read_region(self.scale, (r0, ceil_div(n1, bn)),
                                 (k0 // bk, ceil_div(k1, bk))).float()
            rows = blocks.repeat_interleave(bn, dim=0)[n0 - r0 * bn:n0 - r0 * bn + n]
            return Fp8Weight(codes, rows.contiguous(), bk, self.kind)
        if self.layout == "channel":
            scale = read_region(self.scale, (n0, n1)).float().reshape(n, 1)
        else:
            scale = read_region(self.scale).float().reshape(1, 1).expand(n, 1)
        return Fp8Weight(codes, scale.contiguous(), max(k, 1), self.kind)
