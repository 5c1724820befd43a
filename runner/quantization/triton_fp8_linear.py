"""y = x W^T for an FP8 W (fp8_weight.py) on CUDA, in Triton: the weight stays one byte a
weight, with a float32 scale per output feature and group of input features.

Each K step of BLOCK_K features loads the tile's bytes, moves each e4m3 byte's fields into
a float16's places (the value times 2^-8, exactly; the same decode as csrc/fp8_linear.cpp,
so no fp8 tensor type is needed, and the interpreter runs it), applies the per-group scale
(times 2^8) and multiplies with float32 accumulation. Rows past M, features past N and
columns past K are masked.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from raylm.runner.quantization.fp8_weight import Fp8Weight

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton.jit is
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _fp8_linear_kernel(x_ptr, codes_ptr, scale_ptr, out_ptr, M, N, K, GROUP,
                       stride_xm, stride_cn, stride_sn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wk_ok = n_ok[:, None] & k_ok[None, :]
        b = tl.load(codes_ptr + n[:, None] * stride_cn + k[None, :], mask=wk_ok,
                    other=0).to(tl.int32)
        half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16)
        scale = tl.load(scale_ptr + n[:, None] * stride_sn + k[None, :] // GROUP, mask=wk_ok,
                        other=0.0)
        w = half.to(tl.float16, bitcast=True).to(tl.float32) * scale  # [BLOCK_N, BLOCK_K]
        if DOT_IN_FP32:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32, input_precision=PRECISION)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


class TritonFp8Linear:
    """An Fp8Weight on the device for the Triton kernel: its bytes as uint8 [N, K] and the
    scales (times 2^8) [N, groups]."""

    bits = 8

    def __init__(self, weight: Fp8Weight, device: torch.device | str) -> None:
        n, k = weight.shape
        self.codes = weight.codes.view(torch.uint8).contiguous().to(device)
        self.scale = (weight.scale.float() * 256.0).contiguous().to(device)
        self.out_features, self.in_features = n, k
        self.group = min(weight.group, k)
        self.kind = weight.kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            x = x.float()
        x = x.contiguous()
        m = x.shape[0]
        out = x.new_empty((m, self.out_features))
        if m == 0:
            return out.reshape(*lead, self.out_features)
        block_m = max(16, min(64, triton.next_power_of_2(m)))  # tl.dot: at least 16 rows
        grid = (triton.cdiv(m, block_m), triton.cdiv(self.out_features, BLOCK_N))
        _fp8_linear_kernel[grid](
            x, self.codes, self.scale, out, m, self.out_features, self.in_features, self.group,
            x.stride(0), self.codes.stride(0), self.scale.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32",
            # Triton's CPU interpreter multiplies 16-bit floats wrongly (see triton_paged).
            DOT_IN_FP32=_INTERPRETED or x.dtype == torch.float32,
        )
        return out.reshape(*lead, self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of W as ``dtype`` (an embedding lookup)."""
        ids = ids.reshape(-1).long()
        codes = self.codes[ids].view(torch.float8_e4m3fn).float()
        scale = (self.scale[ids] / 256.0).repeat_interleave(self.group, dim=1)
        return (codes * scale[:, :self.in_features]).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features, device=self.codes.device), dtype)

    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4
