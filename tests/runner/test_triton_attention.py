"""The CUDA paged-attention kernel (Triton), run on CPU by Triton's interpreter against a
per-token float64 reference over the same block-major cache: decode rows, speculative rows
of 1 + k, a chunk with context, prompts longer than a tile, GQA groups of 1, 2 and 3 (not a
power of two), head sizes 64 and 128, block sizes 16 and 32, float32 and bfloat16, a
sliding window (blocks before it never read) and capped scores; and the one-kernel cache
write, padded tokens skipped."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from raylm.runner.attention import triton_paged  # noqa: E402

if type(triton_paged._paged_attention_kernel).__name__ != "InterpretedFunction":
    triton_paged = importlib.reload(triton_paged)  # imported earlier without the interpreter


def _reference(q, k_cache, v_cache, table, length, scale, group, window=0, softcap=0.0):
    """softmax(q k^T) v over positions [0, length) of one sequence (its last ``window``
    when windowed, scores capped when ``softcap``), in float64."""
    bs = k_cache.shape[2]
    pos = torch.arange(max(length - window, 0) if window else 0, length)
    blocks = torch.as_tensor(table)[pos // bs]
    k = k_cache[blocks, :, pos % bs].double()  # [L, Hkv, D]
    v = v_cache[blocks, :, pos % bs].double()
    out = []
    for h in range(q.shape[0]):
        s = (q[h].double() @ k[:, h // group].T) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out.append(torch.softmax(s, -1) @ v[:, h // group])
    return torch.cat(out)


def _run(lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0, window=0,
         softcap=0.0, null_before_window=False, latent=False):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    v_cache = (k_cache if latent  # latent attention: the key is the value
               else torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype))
    free = iter((1 + rng.permutation(num_blocks - 1)).tolist())  # block 0: the null block
    tables = [[next(free) for _ in range(-(-n // block_size))] for n in lens]
    width = max(len(t) for t in tables)
    block_table = np.array([t + [0] * (width - len(t)) for t in tables])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    query = torch.randn(int(qsl[-1]), heads, head_dim).to(dtype)
    if null_before_window:  # blocks freed behind the window: id 0 holds NaN garbage
        k_cache[0], v_cache[0] = float("nan"), float("nan")
        for i, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
            first = max(n - ql - window + 1, 0) // block_size
            block_table[i, :first] = 0
    meta = triton_paged.build_tiles(qsl, np.array(lens), block_table, "cpu")
    scale = head_dim ** -0.5
    out = triton_paged.paged_attention(query, k_cache, v_cache, meta, scale, window, softcap)
    group = heads // kv_heads
    worst = 0.0
    for i, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
        for j in range(ql):
            tok = int(qsl[i]) + j
            want = _reference(query[tok], k_cache, v_cache, tables[i], n - ql + j + 1, scale,
                              group, window, softcap)
            worst = max(worst, float((out[tok].double() - want).abs().max()))
    return meta, worst


# Decodes (short and long contexts), a 1 + 3 speculative row, a 12-token chunk after 30 of
# context, and a 37-token prompt (three tiles).
LENS = [3, 70, 1, 45, 34, 42, 37]
Q_LENS = [1, 1, 1, 1, 4, 12, 37]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 2, 64, 16), (3, 1, 64, 32), (2, 2, 128, 16)], ids=["gqa2-d64-bs16", "gqa3-d64-bs32",
                                                          "mha-d128-bs16"])
def test_every_row_kind_matches_the_reference_in_float32(heads, kv_heads, head_dim, block_size):
    meta, worst = _run(LENS, Q_LENS, heads, kv_heads, head_dim, block_size, torch.float32)
    assert meta.num_tiles == 4 + 1 + 1 + 3 and meta.max_q_len == 16
    assert worst < 1e-5, worst


def test_latent_attention_shape_matches_the_reference():
    """DeepSeek's absorbed MLA: 8 query heads over one KV head of 48 channels (a latent of
    32 and a rotated key of 16; not a power of two, so the kernel pads and masks), the
    value read from the key cache itself."""
    meta, worst = _run(LENS, Q_LENS, 8, 1, 48, 16, torch.float32, latent=True)
    assert worst < 1e-5, worst


def test_bfloat16_within_its_rounding():
    _, worst = _run(LENS, Q_LENS, 4, 2, 64, 16, torch.bfloat16, seed=1)
    assert worst < 3e-2, worst


@pytest.mark.parametrize("window, softcap", [(20, 0.0), (0, 0.5), (7, 2.0)],
                         ids=["window", "softcap", "both"])
def test_a_sliding_window_and_capped_scores_match_the_reference(window, softcap):
    """Windows shorter than a block and spanning several, the blocks wholly before a
    tile's window replaced by a NaN-filled block 0 (as the engine frees them): never
    read. A window of 0 and a cap of 0 are none."""
    _, worst = _run(LENS, Q_LENS, 4, 2, 64, 16, torch.float32, window=window,
                    softcap=softcap, null_before_window=window > 0)
    assert worst < 1e-5, worst


def test_a_negative_window_is_refused():
    meta = triton_paged.build_tiles(np.array([0, 1]), np.array([3]), np.zeros((1, 1), np.int64),
                                    "cpu")
    cache = torch.zeros(1, 1, 16, 16)
    with pytest.raises(ValueError, match="window and softcap"):
        triton_paged.paged_attention(torch.zeros(1, 1, 16), cache, cache, meta, 1.0, window=-1)


def test_tiles_cover_each_row_in_order():
    meta = triton_paged.build_tiles(np.array([0, 1, 21, 24]), np.array([5, 50, 3]),
                                    np.zeros((3, 4), np.int64), "cpu", tile_tokens=16)
    assert meta.row.tolist() == [0, 1, 1, 2]
    assert meta.q_start.tolist() == [0, 1, 17, 21]
    assert meta.q_len.tolist() == [1, 16, 4, 3]
    assert meta.pos0.tolist() == [4, 30, 46, 0]


def test_cache_write_is_one_kernel_and_skips_padding():
    torch.manual_seed(2)
    k_cache = torch.zeros(4, 2, 16, 64)
    v_cache = torch.zeros(4, 2, 16, 64)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([17, -1, 5])
    triton_paged.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, :, 1], key[0]) and torch.equal(v_cache[0, :, 5], value[2])
    assert int((k_cache != 0).any(-1).sum()) == 2 * 2  # two tokens x two heads, not three


def test_cache_write_of_a_latent_head_leaves_the_padding_channels_alone():
    """48 channels (padded to 64 in the kernel) into a cache row of 48: the next row, which
    the padding would reach, is untouched."""
    cache = torch.zeros(2, 1, 4, 48)
    key = torch.randn(2, 1, 48)
    triton_paged.write_kv(key, key, cache, cache, torch.tensor([1, 6]))
    assert torch.equal(cache[0, 0, 1], key[0, 0]) and torch.equal(cache[1, 0, 2], key[1, 0])
    assert int((cache != 0).any(-1).sum()) == 2
