"""An FP8 weight (fp8_weight.py) repacked for the C++ kernel (csrc/fp8_linear.cpp): output
features in tiles of 16, per input feature the tile's 16 bytes side by side, and per tile
and group the 16 scales times 2^8 (the kernel decodes a byte to its value times 2^-8).
One byte a weight plus 4 per group of scales: the float weight is never held."""

from __future__ import annotations

import torch

from raylm.runner.quantization.fp8_weight import Fp8Weight
from raylm.runner.quantization.linear_kernel import load_fp8_linear_kernel

TILE = 16
# Up to this many rows the fused kernel runs; above it W^T is decoded a chunk of output
# features at a time for the dense matmul (as packed_linear.py does for integer codes).
FUSED_MAX_ROWS = 16
_DENSE_CHUNK_BYTES = 1 << 20  # a decoded chunk stays in L2 while the matmul reads it


class Fp8Linear:
    """y = x W^T for an Fp8Weight, kept in its bytes."""

    bits = 8

    def __init__(self, weight: Fp8Weight) -> None:
        if not load_fp8_linear_kernel():
            raise RuntimeError("the FP8 linear kernel could not be built here.")
        n, k = weight.shape
        tiles = -(-n // TILE)
        padded = weight.pad_rows(tiles * TILE)
        codes = padded.codes.view(torch.uint8)
        self.codes = codes.reshape(tiles, TILE, k).transpose(1, 2).contiguous()
        groups = padded.scale.shape[1]
        scale = padded.scale.float() * 256.0  # exact: a power of two
        self.scales = scale.reshape(tiles, TILE, groups).transpose(1, 2).contiguous()
        self.out_features, self.in_features = n, k
        self.group = min(weight.group, k)
        self.kind = weight.kind
        self._linear = torch.ops.raylm_fp8.linear.default

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        lead = None
        if x.dim() != 2:
            lead = x.shape[:-1]
            x = x.reshape(-1, self.in_features)
        if not x.is_contiguous():
            x = x.contiguous()
        if x.shape[0] <= FUSED_MAX_ROWS:
            out = self._linear(x, self.codes, self.scales, self.out_features, self.group)
        else:
            out = self._dense(x)
        return out if lead is None else out.reshape(*lead, self.out_features)

    def _w_t(self, t0: int, t1: int, dtype: torch.dtype) -> torch.Tensor:
        n = min(self.out_features, t1 * TILE) - t0 * TILE
        return torch.ops.raylm_fp8.dequantize_transposed(
            self.codes[t0:t1], self.scales[t0:t1], n, self.group, dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        tiles = self.codes.shape[0]
        step = max(1, _DENSE_CHUNK_BYTES // (self.in_features * x.element_size() * TILE))
        chunks = [torch.mm(x, self._w_t(t0, min(tiles, t0 + step), x.dtype))
                  for t0 in range(0, tiles, step)]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of W as ``dtype`` (an embedding lookup)."""
        ids = ids.reshape(-1).long()
        tile, lane = ids // TILE, ids % TILE
        codes = self.codes[tile, :, lane].view(torch.float8_e4m3fn).float()  # [T, K]
        scale = self.scales[tile, :, lane] / 256.0  # [T, groups]
        w = codes * scale.repeat_interleave(self.group, dim=1)[:, :self.in_features]
        return w.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (the reference the kernel is tested against)."""
        return self._w_t(0, self.codes.shape[0], dtype).t()

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4
