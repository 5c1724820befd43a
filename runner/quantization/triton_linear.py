"""y = x W^T for a group-quantized W on CUDA, in Triton: the weight stays in its codes.

Layout (``TritonQuantLinear``): 4-bit codes two per byte along the input dimension (feature
2i in the low nibble of byte i), 8-bit codes one signed byte each; a float32 scale and
zero per output feature and group of 32 input features, or 16 (Q6_K; group_quantized.py's
form). One program computes a BLOCK_M x BLOCK_N tile of y; each step of its K loop is one
group: it decodes the group's codes for its BLOCK_N features, applies their scale and zero,
and multiplies, accumulating in float32. Rows past M and features past N are masked, so a
decode step of one row and a prefill of thousands share the kernel (the grid depends on
the shapes alone: graph-friendly).

CI runs it on CPU under TRITON_INTERPRET=1 against dequantize-then-matmul (small shapes);
``RAYLM_QUANT_BACKEND=triton`` makes a CPU engine use it there, for end-to-end tests.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from raylm.runner.quantization.act_order import InputOrder
from raylm.runner.quantization.group_quantized import GroupQuantized

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton.jit is
BLOCK_N = 32


@triton.jit
def _quant_linear_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K,
                         stride_xm, stride_cn, stride_sn, stride_om,
                         BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUP: tl.constexpr, PRECISION: tl.constexpr,
                         DOT_IN_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kk = tl.arange(0, GROUP)
    for g in range(0, K // GROUP):
        k = g * GROUP + kk
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        if BITS == 4:
            byte = tl.load(codes_ptr + n[:, None] * stride_cn + (k[None, :] // 2),
                           mask=n_ok[:, None], other=0).to(tl.int32)
            code = (byte >> ((k[None, :] % 2) * 4)) & 15
        else:
            code = tl.load(codes_ptr + n[:, None] * stride_cn + k[None, :],
                           mask=n_ok[:, None], other=0).to(tl.int32)
        scale = tl.load(scale_ptr + n * stride_sn + g, mask=n_ok, other=0.0)
        zero = tl.load(zero_ptr + n * stride_sn + g, mask=n_ok, other=0.0)
        w = code.to(tl.float32) * scale[:, None] + zero[:, None]  # [BLOCK_N, GROUP]
        if DOT_IN_FP32:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32, input_precision=PRECISION)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


class TritonQuantLinear:
    """A GroupQuantized weight on the device for the Triton kernel (about bits + 2 bits
    per weight: the codes, a float32 scale and zero per 32)."""

    def __init__(self, weight: GroupQuantized, device: torch.device | str) -> None:
        n, k = weight.shape
        codes = weight.codes
        if weight.bits == 4:
            codes = codes.to(torch.uint8)
            codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        else:
            codes = codes.to(torch.int8).contiguous()
        self.codes = codes.to(device)
        self.scale = weight.scale.float().contiguous().to(device)
        self.zero = weight.zero.float().contiguous().to(device)
        self.out_features, self.in_features, self.bits = n, k, weight.bits
        self.group_size = weight.group_size
        self.kind = weight.kind
        # Act order: x's features gathered into the weight's column order.
        self.input_order = (None if weight.input_order is None
                            else InputOrder(weight.input_order, device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if self.input_order is not None:
            x = self.input_order.gather(x)
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            x = x.float()
        x = x.contiguous()
        m = x.shape[0]
        out = x.new_empty((m, self.out_features))
        if m == 0:
            return out.reshape(*lead, self.out_features)
        block_m = max(16, min(64, triton.next_power_of_2(m)))  # tl.dot: at least 16 rows
        grid = (triton.cdiv(m, block_m), triton.cdiv(self.out_features, BLOCK_N))
        _quant_linear_kernel[grid](
            x, self.codes, self.scale, self.zero, out, m, self.out_features, self.in_features,
            x.stride(0), self.codes.stride(0), self.scale.stride(0), out.stride(0),
            BITS=self.bits, BLOCK_M=block_m, BLOCK_N=BLOCK_N, GROUP=self.group_size,
            # float32 models keep IEEE products (TF32 would part from transformers' tokens).
            PRECISION="ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32",
            # Triton's CPU interpreter multiplies 16-bit floats wrongly (see triton_paged).
            DOT_IN_FP32=_INTERPRETED or x.dtype == torch.float32,
        )
        return out.reshape(*lead, self.out_features)

    def _codes(self) -> torch.Tensor:
        if self.bits == 4:
            return torch.stack([self.codes & 15, self.codes >> 4], dim=-1).reshape(
                self.out_features, self.in_features)
        return self.codes

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of W as ``dtype`` (an embedding lookup)."""
        ids = ids.reshape(-1).long()
        g = self.group_size
        codes = self._codes()[ids].float().reshape(-1, self.in_features // g, g)
        w = codes * self.scale[ids].unsqueeze(-1) + self.zero[ids].unsqueeze(-1)
        return w.reshape(-1, self.in_features).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] in the input features' order (the kernel's reference)."""
        w = self.rows(torch.arange(self.out_features, device=self.codes.device), dtype)
        return w if self.input_order is None else self.input_order.unpermute(w)

    def nbytes(self) -> int:
        return (self.codes.numel() * self.codes.element_size()
                + 2 * self.scale.numel() * 4)
