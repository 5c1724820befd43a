"""The LoRA products in Triton for CUDA: one shrink and one expand launch per projection.

The tokens of a step sorted by adapter form up to ``num_slots`` segments
(``mapping.TritonBuffers``). Shrink: one program per (tile of BLOCK_M tokens of a
segment, block of the S * R rank columns, segment) computes h = x A[slot]^T for its
tile, the tile's rows gathered through the sorted order, in float32. Expand: one program
per (tile, block of output columns, segment, output slice s of a fused projection) adds
h[:, s*R:(s+1)*R] B[slot] (B stored [R, out]) into the base layer's output. A segment's slot, start and
length are read on the device, so the same launches serve a CUDA graph's replays; tiles
past a segment's end and unused segments (slot -1) return at once.

CI runs both on CPU under TRITON_INTERPRET=1 against the torch path (small shapes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from raylm.runner.lora.mapping import TritonBuffers

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton.jit is
BLOCK_M = 16  # tokens per tile (tl.dot wants at least 16 rows)


def padded_rank(max_lora_rank: int) -> int:
    """The rank columns a Triton slot holds: a power of two of at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(max_lora_rank))


@triton.jit
def _tile(sorted_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, BLOCK_M: tl.constexpr,
          NUM_N_BLOCKS: tl.constexpr):
    """This program's tile: its segment's slot, whether it holds tokens (a tile past its
    segment's end or an unused segment does not), its tokens, which of them are real, and
    its block of columns."""
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    m_block = pid // NUM_N_BLOCKS
    slot = tl.load(seg_slot_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < length
    tokens = tl.load(sorted_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
    live = (slot >= 0) & (m_block * BLOCK_M < length)
    return slot, live, tokens, m_ok, pid % NUM_N_BLOCKS


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, sorted_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr,
                   N, K, stride_xt, stride_as, stride_an, stride_ht,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NUM_N_BLOCKS: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_IN_FP32: tl.constexpr):
    slot, live, tokens, m_ok, n_block = _tile(sorted_ptr, seg_slot_ptr, seg_start_ptr,
                                              seg_len_ptr, BLOCK_M, NUM_N_BLOCKS)
    if live == 0:
        return
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_base + n[None, :] * stride_an + k[:, None],
                     mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at, out_dtype=tl.float32, input_precision=PRECISION)
    tl.store(h_ptr + tokens[:, None] * stride_ht + n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, sorted_ptr, seg_slot_ptr, seg_start_ptr,
                   seg_len_ptr, slice_start_ptr, stride_ht, stride_bs, stride_br, stride_ot,
                   R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_N_BLOCKS: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(2)
    slot, live, tokens, m_ok, n_block = _tile(sorted_ptr, seg_slot_ptr, seg_start_ptr,
                                              seg_len_ptr, BLOCK_M, NUM_N_BLOCKS)
    n_lo = tl.load(slice_start_ptr + s)
    n_hi = tl.load(slice_start_ptr + s + 1)
    if (live == 0) | (n_lo + n_block * BLOCK_N >= n_hi):
        return
    n = n_lo + n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_hi
    r = tl.arange(0, R)
    ht = tl.load(h_ptr + tokens[:, None] * stride_ht + s * R + r[None, :],
                 mask=m_ok[:, None], other=0.0)
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + r[:, None] * stride_br + n[None, :],
                 mask=n_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.dot(ht, bt, out_dtype=tl.float32, input_precision=PRECISION)
    mask = m_ok[:, None] & n_ok[None, :]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + n[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slice_starts: torch.Tensor, widest_slice: int, buffers: TritonBuffers,
             num_tokens: int) -> None:
    """out[t] += (x[t] A[slot(t)]^T) B[slot(t)] over the segments in ``buffers``.
    ``a`` [num_slots, S * R, in], ``b`` [num_slots, R, out] (slice s of the output reads
    h's rank columns s*R ..), ``slice_starts`` [S + 1] the slices' first output columns,
    ``widest_slice`` the most columns of one."""
    if num_tokens == 0:
        return
    x = x.contiguous()
    assert out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    num_slots, n_rank, k = a.shape
    rank = b.shape[1]
    num_slices = slice_starts.numel() - 1
    m_blocks = triton.cdiv(num_tokens, BLOCK_M)
    h = torch.empty((x.shape[0], n_rank), dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32"
    block_n = min(64, triton.next_power_of_2(n_rank))
    n_blocks = triton.cdiv(n_rank, block_n)
    _shrink_kernel[(m_blocks * n_blocks, num_slots)](
        x, a, h, buffers.sorted_tokens, buffers.seg_slot, buffers.seg_start, buffers.seg_len,
        n_rank, k, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=64 if k >= 64 else 16,
        NUM_N_BLOCKS=n_blocks, PRECISION=precision,
        DOT_IN_FP32=_INTERPRETED and x.dtype != torch.float32)
    block_out = min(64, triton.next_power_of_2(widest_slice))
    out_blocks = triton.cdiv(widest_slice, block_out)
    _expand_kernel[(m_blocks * out_blocks, num_slots, num_slices)](
        h, b, out, buffers.sorted_tokens, buffers.seg_slot, buffers.seg_start,
        buffers.seg_len, slice_starts, h.stride(0), b.stride(0), b.stride(1), out.stride(0),
        R=rank, BLOCK_M=BLOCK_M, BLOCK_N=block_out, NUM_N_BLOCKS=out_blocks,
        PRECISION="ieee" if out.dtype == torch.float32 or _INTERPRETED else "tf32")
