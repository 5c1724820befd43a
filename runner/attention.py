"""Paged attention in plain torch (CPU and CUDA, no extra packages).

KV cache, per layer: key and value tensors ``[num_blocks * block_size, num_kv_heads,
head_dim]``; token ``p`` of a request lives in slot ``block_table[p // bs] * bs + p % bs``.
Each step first writes the new keys/values through ``slot_mapping``, then:

- decode rows (query length 1) are batched into ONE padded ``scaled_dot_product_attention``:
  their context is gathered to ``[B, H_kv, L_max, D]`` with a padding mask. GQA costs
  nothing extra: the ``G`` query heads sharing a KV head are laid out as that KV head's
  query "length" (``[B, H_kv, G, D]``), so K/V are never repeated.
- prefill rows (whole prompts or chunks) run one sdpa each; a chunk with earlier context
  reads that context from the cache and uses a causal mask shifted by its offset.

The metadata (slots, masks) is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSpan:
    start: int  # token range [start, end) in the flattened batch
    end: int
    context_len: int  # tokens already in the KV cache before this chunk
    kv_slots: torch.Tensor | None = None  # [context_len + q_len] slots; None if no context
    mask: torch.Tensor | None = None  # [q_len, context_len + q_len] bool; None if no context


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64
    decode_token_indices: torch.Tensor | None = None  # [B_d]; None when no decode rows
    decode_is_all: bool = False  # every token is a decode row, in order: no gather needed
    decode_kv_slots: torch.Tensor | None = None  # [B_d, L_max]
    decode_mask: torch.Tensor | None = None  # [B_d, 1, 1, L_max] bool, True = attend; None
    # when every decode row has length L_max (nothing to mask)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Step-scoped scratch for the decode K/V gather, reused by every layer (each layer's
    # sdpa is done with it before the next layer writes it): saves two large allocations
    # per layer per step.
    decode_kv_workspace: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)


def _slots_for(block_table: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """Slots of positions [0, num_positions) for each row of ``block_table`` [B, nb]."""
    pos = torch.arange(num_positions, device=block_table.device)
    return block_table[:, pos // block_size] * block_size + pos % block_size


def build_attention_metadata(
    query_start_loc: np.ndarray,  # [B + 1] cumulative query lengths
    seq_lens: np.ndarray,  # [B] context + this step's tokens
    slot_mapping: torch.Tensor,  # [T] on the device
    block_table: torch.Tensor,  # [B, nb] on the device (int64)
    block_size: int,
) -> AttentionMetadata:
    num_tokens = int(query_start_loc[-1])
    query_lens = np.diff(query_start_loc)
    meta = AttentionMetadata(num_tokens=num_tokens, slot_mapping=slot_mapping)
    device = block_table.device
    is_decode = query_lens == 1
    decode_rows = np.flatnonzero(is_decode)
    if decode_rows.size:
        decode_lens = seq_lens[decode_rows]
        max_len = int(decode_lens.max())
        meta.decode_is_all = decode_rows.size == num_tokens
        rows_t = None if meta.decode_is_all else torch.from_numpy(decode_rows).to(device)
        table = block_table if rows_t is None else block_table.index_select(0, rows_t)
        meta.decode_kv_slots = _slots_for(table, max_len, block_size)
        if int(decode_lens.min()) < max_len:
            # Ragged rows: mask the padding. Equal lengths need no mask, and sdpa without
            # one is faster (CPU, 120m decode: ~60 us of ~600 per layer).
            lens = torch.from_numpy(decode_lens.astype(np.int64)).to(device)
            meta.decode_mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[
                :, None, None, :]
        if not meta.decode_is_all:
            starts = query_start_loc[:-1][decode_rows].astype(np.int64)
            meta.decode_token_indices = torch.from_numpy(starts).to(device)
    # Prefill rows: few per step (bounded by the token budget), one sdpa each.
    for row in np.flatnonzero(~is_decode).tolist():
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        seq_len = int(seq_lens[row])
        context_len = seq_len - (end - start)
        span = PrefillSpan(start, end, context_len)
        if context_len > 0:
            span.kv_slots = _slots_for(block_table[row:row + 1], seq_len, block_size)[0]
            q_pos = torch.arange(context_len, seq_len, device=device)
            span.mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        meta.prefills.append(span)
    return meta


def _gather(cache: torch.Tensor, slots: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """cache[slots] for an index of any shape (index_select is several times faster on CPU
    than advanced indexing), into ``out`` [slots.numel(), *cache.shape[1:]] if given."""
    if out is None:
        out = cache.index_select(0, slots.reshape(-1))
    else:
        torch.index_select(cache, 0, slots.reshape(-1), out=out)
    return out.view(*slots.shape, *cache.shape[1:])


class Attention(nn.Module):
    """Attention over the paged KV cache for one layer (this rank's heads only)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}.")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.scale = scale
        # (key_cache, value_cache), bound by the model runner once the cache is allocated.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq * D]."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound; call initialize_kv_cache() first.")
        key_cache, value_cache = self.kv_cache
        key_cache.index_copy_(0, meta.slot_mapping, key)
        value_cache.index_copy_(0, meta.slot_mapping, value)
        num_tokens = query.shape[0]
        hidden = self.num_heads * self.head_dim
        if meta.decode_is_all and not meta.prefills:
            return self._decode(query, key_cache, value_cache, meta)
        out = query.new_empty((num_tokens, hidden))
        if meta.decode_kv_slots is not None:
            idx = meta.decode_token_indices
            out[idx] = self._decode(query.index_select(0, idx), key_cache, value_cache, meta)
        for span in meta.prefills:
            out[span.start:span.end] = self._prefill(query, key, value, key_cache, value_cache,
                                                     span)
        return out

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        batch = query.shape[0]
        q = query.reshape(batch, self.num_kv_heads, self.num_queries_per_kv, self.head_dim)
        slots = meta.decode_kv_slots
        shape = (slots.numel(), *key_cache.shape[1:])
        key = (shape, key_cache.dtype)
        if key not in meta.decode_kv_workspace:
            meta.decode_kv_workspace[key] = (key_cache.new_empty(shape),
                                             value_cache.new_empty(shape))
        k_out, v_out = meta.decode_kv_workspace[key]
        k = _gather(key_cache, slots, k_out).transpose(1, 2)  # [B, Hkv, L, D]
        v = _gather(value_cache, slots, v_out).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(batch, self.num_heads * self.head_dim)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 span: PrefillSpan) -> torch.Tensor:
        q_len = span.end - span.start
        q = query[span.start:span.end].reshape(
            q_len, self.num_kv_heads, self.num_queries_per_kv, self.head_dim).permute(1, 2, 0, 3)
        if span.kv_slots is None:
            k, v = key[span.start:span.end], value[span.start:span.end]
        else:
            k, v = _gather(key_cache, span.kv_slots), _gather(value_cache, span.kv_slots)
        # [S, Hkv, D] -> [Hkv, G, S, D] as a stride-0 view over the G query heads of each KV
        # head (no copy; equal shapes keep every sdpa backend eligible).
        shape = (self.num_kv_heads, self.num_queries_per_kv, k.shape[0], self.head_dim)
        k = k.permute(1, 0, 2).unsqueeze(1).expand(shape)
        v = v.permute(1, 0, 2).unsqueeze(1).expand(shape)
        if span.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=self.scale)
        return o.permute(2, 0, 1, 3).reshape(q_len, self.num_heads * self.head_dim)
