"""Ragged paged attention: each query token against exactly the KV blocks it can see.

Every (token, visible block) pair is one batch entry; a softmax computed block by block and
combined per token (scatter-max, then sums) is exact up to float summation order. So the
cost is the sum of the tokens' contexts, not batch x longest as with padded sdpa, and a
row of several tokens is causal by construction. Plain torch ops (CPU and CUDA), scores
and softmax in float32; on CPU, cpu_kernel.py does the same with the blocks in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class _Upload(Protocol):
    def add(self, array: np.ndarray) -> tuple[int, int]: ...


@dataclass
class RaggedTokens:
    """The ragged kernel's inputs for one step, shared by every layer: the (token, block)
    pairs for the torch kernel, or the tokens' block-table rows for the C++ one."""

    num_tokens: int  # N query tokens taking the kernel
    token_index: torch.Tensor | None  # [N] their rows in the step's flat batch; None when
    # they are the whole batch in order (then the output needs no scatter)
    # Torch kernel (None for the C++ one):
    pair_token: torch.Tensor | None = None  # [P] token of each pair, non-decreasing
    pair_block: torch.Tensor | None = None  # [P] cache block of each pair
    bias: torch.Tensor | None = None  # [P, 1, 1, bs] float32: 0 for visible keys, -inf past
    # the token's last key; None when every pair's block is fully visible
    single_pair: bool = False  # every token has one pair: no combine needed
    # Token ranges run one after another, each with its own pairs (t0, t1, p0, p1): the
    # workspace of a step is then bounded by a chunk's pairs, not by the sum of contexts.
    # None: one chunk.
    chunks: list[tuple[int, int, int, int]] | None = None
    # C++ kernel (None for the torch one):
    block_table: torch.Tensor | None = None  # [R, nb] the block tables of the tokens' rows
    token_row: torch.Tensor | None = None  # [N] each token's row of ``block_table``
    kv_len: torch.Tensor | None = None  # [N] keys each token sees
    window: int = 0  # >0: each token sees only its last ``window`` keys, itself included


def build_ragged_tokens(query_start_loc: np.ndarray, seq_lens: np.ndarray,
                        block_table: np.ndarray, rows: np.ndarray, block_size: int,
                        num_batch_tokens: int, upload: _Upload, pairs: bool = True,
                        max_pairs: int | None = None, window: int = 0
                        ) -> Callable[[torch.Tensor], RaggedTokens]:
    """Metadata for the query tokens of ``rows`` (host numpy, vectorised): their pairs
    when ``pairs`` (the torch kernel), else their rows and key counts (the C++ kernel).
    The index arrays are added to ``upload``; the returned function takes the uploaded
    tensor and slices them out. ``max_pairs``: the most pairs the torch kernel takes at
    once (whole tokens per chunk; a token with more pairs runs alone). ``window`` > 0: a
    token sees only its last ``window`` keys (itself included), a sliding-window layer."""
    bs = block_size
    qlens = query_start_loc[rows + 1] - query_start_loc[rows]
    num_tokens = int(qlens.sum())
    tok_row = np.repeat(rows, qlens)
    first = np.cumsum(qlens) - qlens
    tok = np.repeat(query_start_loc[rows], qlens) + np.arange(num_tokens) - np.repeat(first,
                                                                                   qlens)
    # Keys a token sees: its row's context before the step, plus the row's tokens up to
    # and including itself.
    kv_len = seq_lens[tok_row] - query_start_loc[tok_row + 1] + tok + 1
    assert (kv_len >= 1).all(), f"a query token sees no keys: kv_len={kv_len.tolist()}"
    nblk = -(-kv_len // bs)
    # The first key a token sees, and its first visible block (0 without a window).
    first_key = np.maximum(kv_len - window, 0) if window > 0 else np.zeros_like(kv_len)
    first_blk = first_key // bs
    max_blocks = block_table.shape[1]
    assert int(nblk.max()) <= max_blocks, (
        f"a token needs {int(nblk.max())} blocks but the block table has {max_blocks}")
    all_in_order = num_tokens == num_batch_tokens
    at_index = None if all_in_order else upload.add(tok)
    if not pairs:
        width = int(nblk.max())
        at_table = upload.add(block_table[rows, :width])
        at_row = upload.add(np.repeat(np.arange(rows.size), qlens))
        at_len = upload.add(kv_len)

        def finish_rows(uploaded: torch.Tensor) -> RaggedTokens:
            return RaggedTokens(
                num_tokens=num_tokens,
                token_index=None if at_index is None else uploaded[at_index[0]:at_index[1]],
                block_table=uploaded[at_table[0]:at_table[1]].view(rows.size, width),
                token_row=uploaded[at_row[0]:at_row[1]], kv_len=uploaded[at_len[0]:at_len[1]],
                window=window)

        return finish_rows
    npairs = nblk - first_blk
    num_pairs = int(npairs.sum())
    pair_token = np.repeat(np.arange(num_tokens), npairs)
    pair_pos = (np.arange(num_pairs) - np.repeat(np.cumsum(npairs) - npairs, npairs)
                + first_blk[pair_token])
    pair_block = block_table[tok_row[pair_token], pair_pos]
    visible = kv_len[pair_token] - pair_pos * bs  # keys of the block the token sees (>= 1)
    hidden = first_key[pair_token] - pair_pos * bs  # leading keys before the window (<= 0: none)
    masked = bool((visible < bs).any() or (hidden > 0).any())
    at_token = upload.add(pair_token)
    at_block = upload.add(pair_block)
    at_visible = upload.add(visible) if masked else None
    at_hidden = upload.add(hidden) if masked else None
    single_pair = bool((npairs == 1).all())
    chunks = (pair_chunks(npairs, max_pairs)
              if max_pairs is not None and num_pairs > max_pairs else None)

    def finish(uploaded: torch.Tensor) -> RaggedTokens:
        bias = None
        if at_visible is not None and at_hidden is not None:
            vis = uploaded[at_visible[0]:at_visible[1]]
            before = uploaded[at_hidden[0]:at_hidden[1]]
            keys = torch.arange(bs, device=uploaded.device)
            bias = torch.zeros(vis.numel(), 1, 1, bs, dtype=torch.float32,
                               device=uploaded.device)
            outside = (keys[None, :] >= vis[:, None]) | (keys[None, :] < before[:, None])
            bias.masked_fill_(outside.view(-1, 1, 1, bs), float("-inf"))
        return RaggedTokens(
            num_tokens=num_tokens,
            token_index=None if at_index is None else uploaded[at_index[0]:at_index[1]],
            pair_token=uploaded[at_token[0]:at_token[1]],
            pair_block=uploaded[at_block[0]:at_block[1]],
            bias=bias, single_pair=single_pair, chunks=chunks)

    return finish


def pair_chunks(pairs_per_token: np.ndarray, max_pairs: int) -> list[tuple[int, int, int, int]]:
    """Split tokens (in order) into runs of at most ``max_pairs`` pairs each, a token never
    split: ``(t0, t1, p0, p1)`` per run."""
    if max_pairs < 1:
        raise ValueError(f"max_pairs must be at least 1, got {max_pairs}.")
    ends = np.cumsum(pairs_per_token)
    chunks = []
    t0 = p0 = 0
    num_tokens = len(pairs_per_token)
    while t0 < num_tokens:
        # The last token whose pairs still fit after p0 (at least one token per run).
        t1 = max(t0 + 1, int(np.searchsorted(ends, p0 + max_pairs, side="right")))
        p1 = int(ends[t1 - 1])
        chunks.append((t0, t1, p0, p1))
        t0, p0 = t1, p1
    return chunks


def ragged_paged_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, meta: RaggedTokens,
                           scale: float, softcap: float = 0.0) -> torch.Tensor:
    """query [N, Hq, D] (the ragged tokens, in ``meta``'s order), caches
    ``[num_blocks, Hkv, bs, D]`` -> [N, Hq * D] in the query's dtype. ``softcap`` > 0:
    each score capped to softcap * tanh(score / softcap) before the softmax (Gemma 2)."""
    num_tokens, num_heads, head_dim = query.shape
    assert num_tokens == meta.num_tokens, (
        f"query has {num_tokens} tokens, the metadata {meta.num_tokens}")
    if meta.pair_token is None:  # the C++ kernel's metadata
        return torch.ops.raylm.paged_attention(query, key_cache, value_cache, meta.block_table,
                                               meta.token_row, meta.kv_len, scale, meta.window,
                                               softcap)
    assert meta.pair_block is not None and meta.pair_token is not None
    if meta.chunks is None:
        return _pairs_attention(query, key_cache, value_cache, meta.pair_token,
                                meta.pair_block, meta.bias, meta.single_pair, scale, softcap)
    out = query.new_empty((num_tokens, num_heads * head_dim))
    for t0, t1, p0, p1 in meta.chunks:
        bias = None if meta.bias is None else meta.bias[p0:p1]
        out[t0:t1] = _pairs_attention(query[t0:t1], key_cache, value_cache,
                                      meta.pair_token[p0:p1] - t0, meta.pair_block[p0:p1],
                                      bias, meta.single_pair, scale, softcap)
    return out


def _pairs_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     pair_token: torch.Tensor, pair_block: torch.Tensor,
                     bias: torch.Tensor | None, single_pair: bool, scale: float,
                     softcap: float = 0.0) -> torch.Tensor:
    """The torch kernel over one run of tokens and their pairs."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    q = query.view(num_tokens, num_kv_heads, group, head_dim).index_select(0, pair_token)
    k = key_cache.index_select(0, pair_block)  # [P, Hkv, bs, D]
    v = value_cache.index_select(0, pair_block)
    s = torch.matmul(q, k.transpose(-1, -2))  # [P, Hkv, G, bs]
    s = s.float() if s.dtype != torch.float32 else s
    s.mul_(scale)
    if softcap > 0:
        s = s.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        s.add_(bias)
    # The softmax over a token's keys, spread over its pairs: subtract the token's own max
    # (over all its pairs; finite, every pair sees at least one key), exponentiate, and
    # sum numerators and normalisers per token.
    m = s.amax(-1, keepdim=True)
    if not single_pair:
        token_max = torch.full((num_tokens, num_kv_heads, group, 1), float("-inf"),
                               dtype=torch.float32, device=q.device)
        token_max.scatter_reduce_(0, pair_token.view(-1, 1, 1, 1).expand_as(m), m,
                                  reduce="amax")
        m = token_max.index_select(0, pair_token)
    p = s.sub_(m).exp_()
    l = p.sum(-1, keepdim=True)  # noqa: E741 (the softmax normaliser's usual name)
    o = torch.matmul(p.to(v.dtype), v)  # [P, Hkv, G, D]
    o = o.float() if o.dtype != torch.float32 else o
    if single_pair:
        out = o.div_(l)
    else:
        out = torch.zeros((num_tokens, num_kv_heads, group, head_dim), dtype=torch.float32,
                          device=q.device).index_add_(0, pair_token, o)
        out.div_(torch.zeros((num_tokens, num_kv_heads, group, 1), dtype=torch.float32,
                             device=q.device).index_add_(0, pair_token, l))
    return out.to(query.dtype).reshape(num_tokens, num_heads * head_dim)
