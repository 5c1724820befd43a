"""A group-quantized weight repacked for the C++ kernel (csrc/quantized_linear.cpp):
output features in tiles of 16, each tile's codes for input features k and k+1 side by
side, scales and zeros per tile and group (of 32, or Q6_K's 16)."""

from __future__ import annotations

import functools

import torch

from raylm.runner.quantization.act_order import InputOrder
from raylm.runner.quantization.group_quantized import GroupQuantized
from raylm.runner.quantization.linear_kernel import load_quantized_linear_kernel

TILE = 16
# Up to this many rows the fused kernel runs; above it W^T is decoded a chunk of output
# features at a time for the dense matmul, which then outruns the fused kernel (measured
# on the default model's shapes, bench/quant.py's machine: at 32 float32 rows the two tie).
FUSED_MAX_ROWS = 32
# With AMX, bfloat16 rows above this many run on its tiles (at 4 rows fused and AMX tie).
FUSED_MAX_ROWS_BF16 = 4
_DENSE_CHUNK_BYTES = 1 << 20  # a decoded chunk stays in L2 while the matmul reads it


@functools.cache
def _has_amx() -> bool:
    return bool(torch.ops.raylm_quant.has_amx())


class PackedLinear:
    """y = x W^T for a GroupQuantized W, kept packed (about bits + 2 bits per weight)."""

    def __init__(self, weight: GroupQuantized) -> None:
        if not load_quantized_linear_kernel():
            raise RuntimeError("the quantized-linear kernel could not be built here.")
        n, k = weight.shape
        tiles = -(-n // TILE)
        pad = tiles * TILE - n
        codes, scale, zero = weight.codes, weight.scale, weight.zero
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, k)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        # [tiles, 16, K/2, 2] -> [tiles, K/2, 16, 2]: per pair, the tile's 16 features.
        pairs = codes.reshape(tiles, TILE, k // 2, 2).transpose(1, 2)
        if weight.bits == 4:
            lo, hi = pairs[..., 0].to(torch.uint8), pairs[..., 1].to(torch.uint8)
            self.codes = (lo | (hi << 4)).contiguous()
        else:
            self.codes = pairs.to(torch.int8).contiguous().view(torch.int16).squeeze(-1)
            self.codes = self.codes.contiguous()
        groups = k // weight.group_size
        both = torch.stack([scale, zero]).float()  # [2, N, groups]
        self.scales = both.reshape(2, tiles, TILE, groups).permute(1, 3, 0, 2).contiguous()
        self.out_features, self.in_features, self.bits = n, k, weight.bits
        self.group_size = weight.group_size
        # Act order: x's features gathered into the weight's column order.
        self.input_order = (None if weight.input_order is None
                            else InputOrder(weight.input_order, "cpu"))
        self.kind = weight.kind
        # The operators' resolved overloads (a call skips the overload lookup).
        self._linear = torch.ops.raylm_quant.linear.default
        self._linear_amx = torch.ops.raylm_quant.linear_amx.default if _has_amx() else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this once per linear: the common case (a contiguous 2-D
        # float32 or bfloat16 x) goes straight to the operator.
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        lead = None
        if x.dim() != 2:
            lead = x.shape[:-1]
            x = x.reshape(-1, self.in_features)
        if self.input_order is not None:
            x = self.input_order.gather(x)
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.shape[0]
        if (rows > FUSED_MAX_ROWS_BF16 and x.dtype == torch.bfloat16
                and self._linear_amx is not None):
            out = self._linear_amx(x, self.codes, self.scales, self.out_features, self.bits,
                                   self.group_size)
        elif rows <= FUSED_MAX_ROWS:
            out = self._linear(x, self.codes, self.scales, self.out_features, self.bits,
                               self.group_size)
        else:
            out = self._dense(x)
        return out if lead is None else out.reshape(*lead, self.out_features)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        chunks = []
        step = max(1, _DENSE_CHUNK_BYTES // (self.in_features * x.element_size() * TILE))
        for t0 in range(0, self.codes.shape[0], step):
            codes = self.codes[t0:t0 + step]
            n = min(self.out_features - t0 * TILE, codes.shape[0] * TILE)
            scales = self.scales[t0:t0 + step]
            w_t = torch.ops.raylm_quant.dequantize_transposed(codes, scales, n, self.bits,
                                                              x.dtype, self.group_size)
            chunks.append(torch.mm(x, w_t))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of W as ``dtype`` [len(ids), K] (an embedding lookup): each row's
        codes gathered from its tile's lane."""
        ids = ids.reshape(-1).long()
        tile, lane = ids // TILE, ids % TILE
        k = self.in_features
        pairs = self.codes[tile, :, lane]  # [T, K/2]
        if self.bits == 4:
            codes = torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(-1, k).float()
        else:
            codes = pairs.view(torch.int8).reshape(-1, k).float()
        scales = self.scales[tile, :, :, lane]  # [T, groups, 2]
        g = self.group_size
        w = codes.reshape(-1, k // g, g) * scales[..., 0:1] + scales[..., 1:2]
        return w.reshape(-1, k).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (the reference the kernel is tested against)."""
        w_t = torch.ops.raylm_quant.dequantize_transposed(self.codes, self.scales,
                                                          self.out_features, self.bits, dtype,
                                                          self.group_size)
        if self.input_order is None:
            return w_t.t()
        return self.input_order.unpermute(w_t.t())  # back to the features' order

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4
