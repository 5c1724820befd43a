"""Paged attention against a per-row reference: ragged decode rows, multi-token rows
(speculative-style, causal inside the row), a short chunk and a long chunk with context, in
one step through the block-major cache."""

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
    # Decode rows alternate short and long contexts; then a 4-token row (1 + 3 speculative
    # tokens) after 37 of context, a 5-token chunk after 9 (both ragged, causal inside the
    # row), a 12-token chunk after 30 and a 10-token prompt (both through sdpa).
    lens = [int(rng.integers(3, 12)) if i % 2 else int(rng.integers(60, 90))
            for i in range(num_decode)] + [41, 14, 42, 10]
    q_lens = [1] * num_decode + [4, 5, 12, 10]
    attn, meta, tables, qsl, query, out = _step(rng, lens, q_lens, torch.float32)
    assert meta.ragged is not None and meta.ragged.bias is not None  # partial blocks masked
    assert meta.ragged.num_tokens == num_decode + 4 + 5
    assert [(p.start, p.end) for p in meta.prefills] == [(int(qsl[-3]), int(qsl[-2])),
                                                         (int(qsl[-2]), int(qsl[-1]))]
    _check(attn, tables, qsl, query, out, lens, q_lens, tol=1e-5)


def _check(attn, tables, qsl, query, out, lens, q_lens, tol):
    """Every query token's output against the float32 reference over the cache, which now
    holds this step's keys and values too."""
    cache_k, cache_v = (c.float() for c in attn.kv_cache)
    for i, (n, ql) in enumerate(zip(lens, q_lens)):
        for j in range(ql):
            tok = int(qsl[i]) + j
            want = _reference(query[tok].float(), cache_k, cache_v, tables[i], n - ql + j + 1,
                              D ** -0.5)
            torch.testing.assert_close(out[tok].float(), want, atol=tol, rtol=tol)


def _step(rng, lens, q_lens, dtype):
    attn = Attention(HQ, D, HKV, scale=D ** -0.5)
    attn.kv_cache = allocate_kv_cache(NUM_BLOCKS, BS, HKV, D, dtype, "cpu")
    for c in attn.kv_cache:
        c.normal_()
    free = iter(rng.permutation(NUM_BLOCKS).tolist())
    tables = [[next(free) for _ in range(-(-n // BS))] for n in lens]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.cat([torch.tensor([tables[i][p // BS] * BS + p % BS
                                     for p in range(n - ql, n)])
                       for i, (n, ql) in enumerate(zip(lens, q_lens))])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    meta = build_attention_metadata(qsl, np.array(lens), slots, block_table, BS)
    t = int(qsl[-1])
    query = torch.randn(t, HQ, D).to(dtype)
    key, value = torch.randn(t, HKV, D).to(dtype), torch.randn(t, HKV, D).to(dtype)
    return attn, meta, tables, qsl, query, attn(query, key, value, meta)


def test_all_decode_rows_need_no_scatter_and_match_the_reference():
    """The steady decode step: every token is a ragged row, one block or many."""
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    lens = [1, 4, 5, 8, 9, 33, 64, 3]
    attn, meta, tables, qsl, query, out = _step(rng, lens, [1] * len(lens), torch.float32)
    assert meta.ragged.token_index is None and not meta.ragged.single_pair
    cache_k, cache_v = attn.kv_cache
    for i, n in enumerate(lens):
        want = _reference(query[i], cache_k, cache_v, tables[i], n, D ** -0.5)
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-5)


def test_bfloat16_cache_accumulates_in_float32():
    """bf16 model: the output stays within bf16 rounding of the float32 reference computed
    from the same bf16 values (scores and the combine are float32)."""
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    lens, q_lens = [70, 5, 90, 33, 20], [1, 1, 3, 1, 20]
    attn, meta, tables, qsl, query, out = _step(rng, lens, q_lens, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    _check(attn, tables, qsl, query, out, lens, q_lens, tol=2e-2)
