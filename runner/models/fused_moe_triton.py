"""The sparse expert MLP in Triton for CUDA: two grouped GEMM launches over the (token,
slot) pairs sorted by expert, with no host sync (the torch path reads each expert's count
on the host to slice its tokens).

The pairs sorted by expert form one segment per local expert (a pair routed to another
rank's expert goes to a last, skipped segment). Launch 1: one program per (expert, tile
of BLOCK_M of its pairs, block of BLOCK_N intermediate columns) computes the gate and up
products of its tile's token rows, gathered through the sorted order, and stores
SiLU(gate) * up for each pair. Launch 2: one program per (expert, tile, block of hidden
columns) multiplies by the expert's down projection and the pair's routing weight, and
stores the pair's output row; the pairs of a token are then summed (its top-k slots).
Tiles past a segment's end return at once, so the grid is sized from the token count
alone (graph-friendly).

CI runs it on CPU under TRITON_INTERPRET=1 against the torch path (small shapes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton.jit is
BLOCK_M = 16  # pairs per tile (tl.dot wants at least 16 rows)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, order_ptr, seg_start_ptr, seg_len_ptr,
                    inter, hidden, top_k, stride_xt, stride_we, stride_wn, stride_hp,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    expert = tl.program_id(0)
    tile = tl.program_id(1)
    n_block = tl.program_id(2)
    seg_len = tl.load(seg_len_ptr + expert)
    if tile * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_start_ptr + expert)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < seg_len
    pairs = tl.load(order_ptr + seg_start + m, mask=m_ok, other=0)
    tokens = pairs // top_k
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        xt = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wg = tl.load(w_base + n[None, :] * stride_wn + k[:, None],
                     mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
        wu = tl.load(w_base + (n[None, :] + inter) * stride_wn + k[:, None],
                     mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
        gate += tl.dot(xt, wg, input_precision=PRECISION)
        up += tl.dot(xt, wu, input_precision=PRECISION)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + pairs[:, None] * stride_hp + n[None, :],
             act.to(h_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, weight_ptr, order_ptr, seg_start_ptr, seg_len_ptr,
                 hidden, inter, stride_hp, stride_we, stride_wn, stride_op,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    expert = tl.program_id(0)
    tile = tl.program_id(1)
    n_block = tl.program_id(2)
    seg_len = tl.load(seg_len_ptr + expert)
    if tile * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_start_ptr + expert)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < seg_len
    pairs = tl.load(order_ptr + seg_start + m, mask=m_ok, other=0)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        ht = tl.load(h_ptr + pairs[:, None] * stride_hp + k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wt = tl.load(w_base + n[None, :] * stride_wn + k[:, None],
                     mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.dot(ht, wt, input_precision=PRECISION)
    weight = tl.load(weight_ptr + pairs, mask=m_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_op + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, experts: torch.Tensor, first_expert: int
                  ) -> torch.Tensor:
    """sum over each token's top-k slots of weight * w2[e] (SiLU(gate) * up), for the slots
    whose expert e is local (``first_expert`` .. + ``w13.shape[0]``); [T, hidden].
    ``w13`` [E, 2I, hidden] (gate rows then up rows), ``w2`` [E, hidden, I], ``weights``
    and ``experts`` [T, k]."""
    num_tokens, top_k = experts.shape
    num_local, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return x.new_zeros((0, hidden))
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    local = experts.reshape(-1) - first_expert
    # Another rank's expert: the last segment, which no program reads.
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_local + 1)
    seg_start = torch.cumsum(counts, 0) - counts
    pairs = num_tokens * top_k
    tiles = triton.cdiv(pairs, BLOCK_M)
    precision = "ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32"
    block_k = 64 if hidden >= 64 else 16
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    block_n = max(16, min(64, triton.next_power_of_2(inter)))
    _gate_up_kernel[(num_local, tiles, triton.cdiv(inter, block_n))](
        x, w13, h, order, seg_start, counts, inter, hidden, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision)
    out = torch.zeros((pairs, hidden), dtype=x.dtype, device=x.device)
    block_n = max(16, min(64, triton.next_power_of_2(hidden)))
    _down_kernel[(num_local, tiles, triton.cdiv(hidden, block_n))](
        h, w2, out, weights.reshape(-1).contiguous(), order, seg_start, counts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=64 if inter >= 64 else 16,
        PRECISION=precision)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
