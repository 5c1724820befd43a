"""Paged attention against a per-row reference: ragged decode rows, multi-token rows
(speculative-style, causal inside the row), a short chunk and a long chunk with context, in
one step through the block-major cache. Each case runs both ragged kernels: the torch one
(pairs) and the CPU C++ one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.runner.attention.paged_attention import (
    Attention,
    allocate_kv_cache,
    build_attention_metadata,
)
from raylm.runner.attention.ragged import ragged_paged_attention

BS, HQ, HKV, D, NUM_BLOCKS = 4, 4, 2, 8, 512


def _reference(q, cache_k, cache_v, table, length, scale, window=None):
    """softmax(q k^T) v over positions [0, length) of one sequence (the last ``window`` of
    them with a window), head by head."""
    pos = torch.arange(0 if window is None else max(0, length - window), length)
    blocks = torch.as_tensor(table)[pos // BS]
    k = cache_k[blocks, :, pos % BS]  # [L, Hkv, D]
    v = cache_v[blocks, :, pos % BS]
    group = HQ // HKV
    out = []
    for h in range(HQ):
        s = (q[h] @ k[:, h // group].T) * scale
        out.append(torch.softmax(s, -1) @ v[:, h // group])
    return torch.cat(out)


KERNELS = pytest.mark.parametrize("cpu_kernel", [False, True], ids=["torch", "cpp"])


@pytest.mark.parametrize("num_decode", [6, 32])
@KERNELS
def test_ragged_decode_and_a_prefill_chunk_match_the_reference(num_decode, cpu_kernel):
    rng = np.random.default_rng(num_decode)
    torch.manual_seed(num_decode)
    # Decode rows alternate short and long contexts; then a 4-token row (1 + 3 speculative
    # tokens) after 37 of context, a 5-token chunk after 9 (both ragged, causal inside the
    # row), a 12-token chunk after 30 and a 10-token prompt (both through sdpa).
    lens = [int(rng.integers(3, 12)) if i % 2 else int(rng.integers(60, 90))
            for i in range(num_decode)] + [41, 14, 42, 10]
    q_lens = [1] * num_decode + [4, 5, 12, 10]
    attn, meta, tables, qsl, query, out = _step(rng, lens, q_lens, torch.float32, cpu_kernel)
    assert meta.ragged is not None
    if cpu_kernel:
        assert meta.ragged.pair_token is None and meta.ragged.kv_len is not None
    else:
        assert meta.ragged.bias is not None  # partial blocks masked
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
                              attn.scale, attn.sliding_window)
            torch.testing.assert_close(out[tok].float(), want, atol=tol, rtol=tol)


def _step(rng, lens, q_lens, dtype, cpu_kernel, max_pairs=None, window=None, head_dim=D):
    attn = Attention(HQ, head_dim, HKV, scale=head_dim ** -0.5, sliding_window=window)
    attn.kv_cache = allocate_kv_cache(NUM_BLOCKS, BS, HKV, head_dim, dtype, "cpu")
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
    meta = build_attention_metadata(qsl, np.array(lens), slots, block_table, BS, cpu_kernel,
                                    max_pairs=max_pairs)
    t = int(qsl[-1])
    query = torch.randn(t, HQ, head_dim).to(dtype)
    key = torch.randn(t, HKV, head_dim).to(dtype)
    value = torch.randn(t, HKV, head_dim).to(dtype)
    return attn, meta, tables, qsl, query, attn(query, key, value, meta)


# Windows inside one block, of a block and one key, and across many blocks; head sizes
# of the C++ kernel's generic loop (8) and of its AVX-512 one (64).
@pytest.mark.parametrize("window", [1, 3, BS + 1, 13])
@pytest.mark.parametrize("head_dim", [D, 64])
@KERNELS
def test_a_sliding_window_layer_sees_only_its_last_keys(window, head_dim, cpu_kernel):
    rng = np.random.default_rng(window)
    torch.manual_seed(window)
    # Decode rows short and long, a 4-token speculative row, a 5-token chunk (ragged),
    # a 12-token chunk after context and a 10-token prompt (sdpa, masked by the window).
    lens = [2, 9, 40, 77, 41, 14, 42, 10]
    q_lens = [1, 1, 1, 1, 4, 5, 12, 10]
    attn, meta, tables, qsl, query, out = _step(rng, lens, q_lens, torch.float32, cpu_kernel,
                                                window=window, head_dim=head_dim)
    windowed = meta.for_window(window)
    assert windowed is meta.for_window(window)  # built once per step, shared by the layers
    assert windowed.ragged is not None and len(windowed.prefills) == 2
    _check(attn, tables, qsl, query, out, lens, q_lens, tol=1e-5)


def test_a_window_reads_fewer_blocks_than_full_attention():
    lens = [77]
    qsl = np.array([0, 1])
    table = np.arange(20)[None, :]
    slots = torch.tensor([table[0, 76 // BS] * BS + 76 % BS])
    meta = build_attention_metadata(qsl, np.array(lens), slots, table, BS, cpu_kernel=False)
    full = meta.ragged.pair_block.tolist()
    windowed = meta.for_window(6).ragged.pair_block.tolist()
    assert full == list(range(20)) and windowed == [17, 18, 19]  # keys 71..76


@KERNELS
def test_all_decode_rows_need_no_scatter_and_match_the_reference(cpu_kernel):
    """The steady decode step: every token is a ragged row, one block or many."""
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    lens = [1, 4, 5, 8, 9, 33, 64, 3]
    attn, meta, tables, qsl, query, out = _step(rng, lens, [1] * len(lens), torch.float32,
                                                cpu_kernel)
    assert meta.ragged.token_index is None
    assert meta.ragged.single_pair is False and (meta.ragged.pair_token is None) == cpu_kernel
    cache_k, cache_v = attn.kv_cache
    for i, n in enumerate(lens):
        want = _reference(query[i], cache_k, cache_v, tables[i], n, D ** -0.5)
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-5)


def test_torch_kernel_in_bounded_chunks_equals_one_pass():
    """A step whose pairs exceed the workspace cap runs in chunks of whole tokens (a token
    with more pairs than the cap alone): the same outputs, bit for bit, and each chunk
    within the cap."""
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    lens, q_lens = [70, 5, 90, 33, 20, 3, 61], [1, 1, 3, 1, 1, 1, 2]
    _, whole, *_, out_whole = _step(rng, lens, q_lens, torch.float32, cpu_kernel=False)
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    attn, meta, tables, qsl, query, out = _step(rng, lens, q_lens, torch.float32,
                                                cpu_kernel=False, max_pairs=10)
    assert whole.ragged.chunks is None
    chunks = meta.ragged.chunks
    assert chunks is not None and len(chunks) > 3
    pairs = np.diff(np.searchsorted(meta.ragged.pair_token.numpy(),
                                    np.arange(meta.ragged.num_tokens + 1)))
    for t0, t1, p0, p1 in chunks:
        assert p1 - p0 == pairs[t0:t1].sum() and (p1 - p0 <= 10 or t1 == t0 + 1)
    assert [c[0] for c in chunks[1:]] == [c[1] for c in chunks[:-1]]
    assert chunks[-1][1] == meta.ragged.num_tokens
    assert torch.equal(out, out_whole)
    _check(attn, tables, qsl, query, out, lens, q_lens, tol=1e-5)


@KERNELS
def test_bfloat16_cache_accumulates_in_float32(cpu_kernel):
    """bf16 model: the output stays within bf16 rounding of the float32 reference computed
    from the same bf16 values (scores and the combine are float32)."""
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    lens, q_lens = [70, 5, 90, 33, 20], [1, 1, 3, 1, 20]
    attn, meta, tables, qsl, query, out = _step(rng, lens, q_lens, torch.bfloat16, cpu_kernel)
    assert out.dtype == torch.bfloat16
    _check(attn, tables, qsl, query, out, lens, q_lens, tol=2e-2)


@pytest.mark.parametrize("softcap", [0.0, 0.5], ids=["plain", "softcapped"])
@pytest.mark.parametrize("head_dim,group,block_size", [(32, 2, 32), (64, 3, 16), (128, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_kernel_at_model_head_sizes_matches_the_torch_kernel(head_dim, group, block_size,
                                                                 dtype, softcap):
    """The C++ kernel's vectorised head sizes (keys 16 at a time, partial chunks at the end
    of a context and of a block) against the torch kernel and a float64 softmax: decode
    rows of 1-200 keys and a 1 + 3 speculative row. Soft-capped (Gemma 2): every score
    softcap * tanh(score / softcap) first, in both kernels (a cap this low changes every
    output)."""
    rng = np.random.default_rng(head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    hkv = 2
    lens = [1, 15, 16, 17, 33, 64, 100, 200, 40]
    q_lens = [1] * 8 + [4]
    tables = []
    free = iter(rng.permutation(400).tolist())
    for n in lens:
        tables.append([next(free) for _ in range(-(-n // block_size))])
    width = max(len(t) for t in tables)
    block_table = np.array([t + [0] * (width - len(t)) for t in tables])
    k_cache = torch.randn(400, hkv, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(400, hkv, block_size, head_dim, generator=gen).to(dtype)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, hkv * group, head_dim, generator=gen).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    slots = torch.zeros(num_tokens, dtype=torch.int64)  # unused: no cache write here
    outs = {}
    for cpu_kernel in (True, False):
        meta = build_attention_metadata(qsl, np.array(lens), slots, block_table, block_size,
                                        cpu_kernel)
        assert (meta.ragged.kv_len is not None) == cpu_kernel
        outs[cpu_kernel] = ragged_paged_attention(query, k_cache, v_cache, meta.ragged,
                                                  head_dim ** -0.5, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=tol, rtol=tol)
    kf, vf = k_cache.double(), v_cache.double()
    for i, (n, ql) in enumerate(zip(lens, q_lens)):
        pos = torch.arange(n)
        blocks = torch.as_tensor(tables[i])[pos // block_size]
        k, v = kf[blocks, :, pos % block_size], vf[blocks, :, pos % block_size]  # [n, Hkv, D]
        for j in range(ql):
            tok = int(qsl[i]) + j
            seen = n - ql + j + 1
            for head in range(hkv * group):
                s = (query[tok, head].double() @ k[:seen, head // group].T) * head_dim ** -0.5
                if softcap:
                    s = torch.tanh(s / softcap) * softcap
                want = torch.softmax(s, -1) @ v[:seen, head // group]
                got = outs[True][tok, head * head_dim:(head + 1) * head_dim].double()
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_kernel_build_failure_or_opt_out_falls_back_to_the_torch_kernel(monkeypatch, caplog,
                                                                         tmp_path):
    """No compiler (no cached build, and the build raises) or RAYLM_CPU_ATTENTION_KERNEL=0:
    the metadata is the torch kernel's (pairs), and a failed build says why in a warning."""
    from torch.utils import cpp_extension

    from raylm.runner.attention import cpu_kernel as cpu_attention

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    qsl, lens = np.array([0, 1, 2]), np.array([5, 9])
    table, slots = np.array([[0, 1, 2], [3, 4, 5]]), torch.tensor([4, 12])
    try:
        cpu_attention.load_cpu_attention_kernel.cache_clear()
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no build cached there
        monkeypatch.setattr(cpp_extension, "load", no_compiler)
        meta = build_attention_metadata(qsl, lens, slots, table, BS)
        assert meta.ragged.pair_token is not None and meta.ragged.kv_len is None
        assert "no C++ compiler" in caplog.text and "torch kernel" in caplog.text
        monkeypatch.undo()
        cpu_attention.load_cpu_attention_kernel.cache_clear()
        monkeypatch.setenv("RAYLM_CPU_ATTENTION_KERNEL", "0")
        meta = build_attention_metadata(qsl, lens, slots, table, BS)
        assert meta.ragged.pair_token is not None and meta.ragged.kv_len is None
    finally:
        monkeypatch.undo()
        cpu_attention.load_cpu_attention_kernel.cache_clear()
    meta = build_attention_metadata(qsl, lens, slots, table, BS)  # built again: the C++ one
    assert meta.ragged.pair_token is None and meta.ragged.kv_len.tolist() == [5, 9]
