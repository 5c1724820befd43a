"""Paged attention in Triton for CUDA: every row kind of a step in one kernel, KV read in place.

One program per (query tile, KV head): a tile is up to ``TILE_TOKENS`` consecutive query
tokens of one row (a decode is a tile of one; a speculative row of 1 + k, a chunk or a
prompt is one or more tiles), and its rows are the tile's tokens x the G query heads that
share the KV head (GQA). The program walks the row's KV blocks through its block table
with an online softmax (float32), the causal limit inside the row applied per token, and
a layer's sliding window (the blocks before it skipped) and score cap; no K/V is copied. Its metadata is four int32 arrays per step (``TileMetadata``), the same
for every layer. The cache write is one kernel per layer (``write_kv``).

CI runs it on CPU under TRITON_INTERPRET=1 against the torch reference (small shapes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton.jit is

# Query tokens per tile: decodes use a tile of 1 (no masked waste); longer rows reuse
# each K/V block over this many tokens.
TILE_TOKENS = 16


@dataclass
class TileMetadata:
    """Per tile: its row in the block table, its first token in the flat batch, its token
    count, and the sequence position of its first token (the keys before it: context)."""

    row: torch.Tensor  # [N] int32
    q_start: torch.Tensor  # [N] int32
    q_len: torch.Tensor  # [N] int32
    pos0: torch.Tensor  # [N] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    max_q_len: int  # the longest tile, a power of two (constexpr of the kernel)

    @property
    def num_tiles(self) -> int:
        return int(self.row.shape[0])


def tile_arrays(query_start_loc: np.ndarray, seq_lens: np.ndarray,
                tile_tokens: int = TILE_TOKENS) -> np.ndarray:
    """[4, N] int32 host array of the tiles' (row, q_start, q_len, pos0) for a step: rows
    of ``query_start_loc`` ([B + 1]) with ``seq_lens`` ([B], context + this step's)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    q_lens = np.diff(qsl)
    per_row = -(-q_lens // tile_tokens)
    rows = np.repeat(np.arange(q_lens.size), per_row)
    k = np.arange(rows.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    offset = k * tile_tokens
    tile_len = np.minimum(tile_tokens, q_lens[rows] - offset)
    context = seq_lens - q_lens
    return np.stack([rows, qsl[rows] + offset, tile_len,
                     context[rows] + offset]).astype(np.int32)


def _host(array: np.ndarray, pin: bool) -> torch.Tensor:
    """Pinned on CUDA: the copy to the device then waits for nothing."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
    return host.pin_memory() if pin else host


def _upload(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    return _host(array, torch.device(device).type == "cuda").to(device, non_blocking=True)


def _max_q_len(tiles: np.ndarray) -> int:
    return triton.next_power_of_2(int(tiles[2].max())) if tiles.shape[1] else 1


def build_tiles(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                device: torch.device | str, tile_tokens: int = TILE_TOKENS) -> TileMetadata:
    """Tiles for a step over ``block_table`` ([B, nb], host), uploaded without a wait."""
    tiles = tile_arrays(query_start_loc, seq_lens, tile_tokens)
    dev = _upload(tiles, device)
    return TileMetadata(row=dev[0], q_start=dev[1], q_len=dev[2], pos0=dev[3],
                        block_table=_upload(block_table, device), max_q_len=_max_q_len(tiles))


class TileBuffers:
    """Tile metadata at fixed addresses, for CUDA graphs: a step's tiles and block table
    are copied into these buffers (sized for ``max_rows`` one-token rows and the full block
    table width) and the views handed to the kernel are the same tensors every replay."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device | str) -> None:
        self.tiles = torch.zeros((4, max_rows), dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_rows, max_blocks), dtype=torch.int32,
                                       device=device)

    def fill(self, query_start_loc: np.ndarray, seq_lens: np.ndarray,
             block_table: np.ndarray) -> TileMetadata:
        """Copy a one-token-per-row step's tiles in; the views it returns never move."""
        tiles = tile_arrays(query_start_loc, seq_lens, tile_tokens=1)
        n = tiles.shape[1]
        width = block_table.shape[1]
        pin = self.tiles.is_cuda
        self.tiles[:, :n].copy_(_host(tiles, pin), non_blocking=True)
        self.block_table[:n, :width].copy_(_host(block_table, pin), non_blocking=True)
        return self.views(n)

    def views(self, num_rows: int) -> TileMetadata:
        t = self.tiles[:, :num_rows]
        return TileMetadata(row=t[0], q_start=t[1], q_len=t[2], pos0=t[3],
                            block_table=self.block_table[:num_rows], max_q_len=1)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
    tile_row_ptr, tile_q_start_ptr, tile_q_len_ptr, tile_pos0_ptr,
    scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kh, stride_ks, stride_bt,
    GROUP: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(tile_row_ptr + tile)
    q_start = tl.load(tile_q_start_ptr + tile)
    q_len = tl.load(tile_q_len_ptr + tile)
    pos0 = tl.load(tile_pos0_ptr + tile)
    # Row m of the tile's matrix: token m // GROUP of the tile, query head m % GROUP of
    # this KV head's group.
    m = tl.arange(0, ROWS)
    token = m // GROUP
    head = kv_head * GROUP + m % GROUP
    valid = (token < q_len) & (token < TILE)
    # Channels padded to a power of two (latent attention's 576), the padding masked.
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    q_pos = pos0 + token  # the last key each row may see
    acc = tl.zeros((ROWS, HEAD_DIM_PAD), dtype=tl.float32)
    row_max = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((ROWS,), dtype=tl.float32)
    keys = pos0 + q_len  # keys of the tile's last token
    s = tl.arange(0, BLOCK_SIZE)
    first = 0
    if HAS_WINDOW:  # blocks wholly before the first token's window are never read
        first = tl.maximum(pos0 - window + 1, 0) // BLOCK_SIZE
    for j in range(first, tl.cdiv(keys, BLOCK_SIZE)):
        block = tl.load(block_table_ptr + row * stride_bt + j)
        base = block.to(tl.int64) * stride_kb + kv_head * stride_kh
        kv_offsets = base + s[:, None] * stride_ks + d[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=d_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION) * scale
        if HAS_SOFTCAP:  # softcap * tanh(score / softcap), tanh from one exp (stable)
            x = scores / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            scores = softcap * tl.where(x < 0, -1.0, 1.0) * (1.0 - t) / (1.0 + t)
        key_pos = j * BLOCK_SIZE + s
        visible = (key_pos[None, :] <= q_pos[:, None]) & valid[:, None]
        if HAS_WINDOW:  # each token sees its last `window` keys, itself included
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # Rows with nothing visible yet keep -inf; exp2 of (-inf) - (-inf) must not be NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32,
                                                 input_precision=PRECISION)
        row_max = new_max
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & d_ok[None, :])


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: TileMetadata, scale: float, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """query [T, Hq, D], caches [num_blocks, Hkv, bs, D] -> [T, Hq * D]. ``window`` > 0:
    each token sees only its last ``window`` keys, itself included (a sliding-window
    layer); ``softcap`` > 0: scores capped to softcap * tanh(score / softcap) (Gemma 2)."""
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0 (0: none), got {window} and "
                         f"{softcap}.")
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, cache_dim = key_cache.shape
    group = num_heads // num_kv_heads
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} x {head_dim} do not fit KV heads "
                         f"{num_kv_heads} x {cache_dim}.")
    out = query.new_empty((num_tokens, num_heads, head_dim))
    if meta.num_tiles == 0:
        return out.view(num_tokens, num_heads * head_dim)
    tile = meta.max_q_len
    # tl.dot wants at least 16 rows.
    rows = max(16, triton.next_power_of_2(tile * group))
    _paged_attention_kernel[(meta.num_tiles, num_kv_heads)](
        out, query, key_cache, value_cache, meta.block_table,
        meta.row, meta.q_start, meta.q_len, meta.pos0,
        scale, window, softcap,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        meta.block_table.stride(0),
        GROUP=group, TILE=tile, ROWS=rows, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        # float32 models keep IEEE products (TF32 would part from transformers' tokens).
        PRECISION="ieee" if query.dtype == torch.float32 or _INTERPRETED else "tf32",
        # Triton's CPU interpreter multiplies 16-bit floats wrongly: it runs the products
        # in float32 (CI's runs), the GPU in the model's dtype with float32 accumulation.
        DOT_IN_FP32=_INTERPRETED and query.dtype != torch.float32,
        HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
    )
    return out.view(num_tokens, num_heads * head_dim)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ch, stride_cs,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # a padded token (slot -1) writes nothing
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        dst = (slot // BLOCK_SIZE) * stride_cb + head * stride_ch + (slot % BLOCK_SIZE) * stride_cs
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=d_ok)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=d_ok)
        tl.store(k_cache_ptr + dst + d, k, mask=d_ok)
        tl.store(v_cache_ptr + dst + d, v, mask=d_ok)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] into the caches at ``slot_mapping`` [T] (block * bs + offset;
    -1 skips the token), one kernel for both."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[2], HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
