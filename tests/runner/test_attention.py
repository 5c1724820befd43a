"""Paged attention against a per-row reference: ragged decode rows (one padded sdpa with a
mask) and a prefill chunk with context in the same step, through the block-major cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.runner.attention import Attention, allocate_kv_cache, build_attention_metadata

BS, HQ, HKV, D, NUM_BLOCKS = 4, 4, 2, 8, 512


def _reference(q, cache_k, cache_v, table, length, scale):
    """softmax(q k^T) v over positions [0, length) of one sequence, head by head."""
    pos = torch.arange(length)
    blocks = torch.as_tensor(table)[pos // BS]
    k = cache_k[blocks, :, pos % BS]  # [L, Hkv, D]
    v = cache_v[blocks, :, pos % BS]
    group = HQ // HKV
    out = []
    for h in range(HQ):
        s = (q[h] @ k[:, h // group].T) * scale
        out.append(torch.softmax(s, -1) @ v[:, h // group])
    return torch.cat(out)


@pytest.mark.parametrize("num_decode", [6, 32])
def test_ragged_decode_and_a_prefill_chunk_match_the_reference(num_decode):
    rng = np.random.default_rng(num_decode)
    torch.manual_seed(num_decode)
    attn = Attention(HQ, D, HKV, scale=D ** -0.5)
    attn.kv_cache = allocate_kv_cache(NUM_BLOCKS, BS, HKV, D, torch.float32, "cpu")
    for c in attn.kv_cache:
        c.normal_()
    # Decode rows alternate short and long contexts, then one prefill chunk of 5 tokens
    # after 9 tokens of context.
    lens = [int(rng.integers(3, 12)) if i % 2 else int(rng.integers(60, 90))
            for i in range(num_decode)] + [14]
    q_lens = [1] * num_decode + [5]
    free = iter(rng.permutation(NUM_BLOCKS).tolist())
    tables = [[next(free) for _ in range(-(-n // BS))] for n in lens]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.cat([torch.tensor([tables[i][p // BS] * BS + p % BS
                                     for p in range(n - ql, n)])
                       for i, (n, ql) in enumerate(zip(lens, q_lens))])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    meta = build_attention_metadata(qsl, np.array(lens), slots, block_table, BS)
    assert meta.decode_mask is not None  # ragged: the padding is masked
    t = int(qsl[-1])
    query, key, value = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    out = attn(query, key, value, meta)
    cache_k, cache_v = attn.kv_cache  # now holding this step's keys and values too
    for i, (n, ql) in enumerate(zip(lens, q_lens)):
        for j in range(ql):
            tok = int(qsl[i]) + j
            want = _reference(query[tok], cache_k, cache_v, tables[i], n - ql + j + 1,
                              D ** -0.5)
            torch.testing.assert_close(out[tok], want, atol=1e-5, rtol=1e-5)
