"""Decode attention alone: raylm's ragged paged attention (the CPU C++ kernel and the torch
one) vs padded sdpa, and what doubling one row's context costs each.

    python bench/attention.py [--batch 64] [--dtype float32,bfloat16] [--block-size 16]

Workload: one layer of the 6m model's attention shape (8 query heads, 4 KV heads, head_dim
32), a batch of decode rows whose contexts are drawn uniformly from 16-768 (seeded), K/V
in a block-major paged cache with the rows' blocks drawn at random from a pool of
``--pool-tokens`` positions. "padded sdpa" gathers every row's
blocks up to the longest context and runs one masked ``scaled_dot_product_attention`` (the
previous decode path); "ragged C++" and "ragged torch" are ``raylm.runner.attention.paged_attention`` with
the CPU kernel and with the torch kernel (metadata built once, as in a step, outside the
timing). Then the longest row's context is doubled: a kernel whose cost
follows the sum of contexts barely moves; a padded one pays for every row. The variants
run interleaved, round after round (the 2-core box is shared); times are each variant's
minimum, the doubling cost the median over rounds of the doubled / base ratio. Single-threaded by default and timed in thread CPU time (``--threads`` > 1 times
wall clock instead): on a shared 2-core box wall time mostly measures the neighbours.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from raylm.runner.attention.paged_attention import (
    Attention,
    allocate_kv_cache,
    build_attention_metadata,
)
from raylm.runner.host_memory import keep_freed_host_memory

HQ, HKV, D = 8, 4, 32


def _kv_pool(num_blocks: int, bs: int, dtype: torch.dtype, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K/V pool, allocated as the engine does (huge pages on Linux) and filled
    with seeded noise."""
    k_cache, v_cache = allocate_kv_cache(num_blocks, bs, HKV, D, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for cache in (k_cache, v_cache):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return k_cache, v_cache


def _case(lens: np.ndarray, bs: int, seed: int, cpu_kernel: bool,
          kv: tuple[torch.Tensor, torch.Tensor], base_lens: np.ndarray):
    """``lens`` >= ``base_lens`` row by row: every row keeps the blocks it has at its base
    length, and the blocks a longer row needs beyond them come from the rest of the pool,
    so the base and the doubled batch differ in that one row alone (not in where every
    later row's blocks landed, which moved either kernel by several percent). Every case
    reads the same pool ``kv``: separate allocations would differ in page placement."""
    rng = np.random.default_rng(seed)
    nblk, base = -(-lens // bs), -(-base_lens // bs)
    k_cache, v_cache = kv
    num_blocks = k_cache.shape[0]
    assert num_blocks > int(nblk.sum()), "the pool is smaller than the batch"
    perm = rng.permutation(num_blocks)
    tables, start, extra = [], 0, int(base.sum())
    for n, b in zip(nblk.tolist(), base.tolist(), strict=True):
        tables.append(np.concatenate([perm[start:start + b], perm[extra:extra + n - b]]))
        start += b
        extra += n - b
    width = int(nblk.max())
    table = np.zeros((len(lens), width), np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(len(lens), HQ, D, generator=gen).to(k_cache.dtype)
    slots = torch.from_numpy(table[np.arange(len(lens)), (lens - 1) // bs] * bs + (lens - 1) % bs)
    qsl = np.arange(len(lens) + 1)
    attn = Attention(HQ, D, HKV, scale=D ** -0.5)
    attn.kv_cache = (k_cache, v_cache)
    meta = build_attention_metadata(qsl, lens, slots, table, bs, cpu_kernel)
    assert (meta.ragged.kv_len is not None) == cpu_kernel, "the C++ kernel did not load"

    def ragged() -> torch.Tensor:
        # The cache write of a step is part of attention; keys/values are the cache's own.
        return attn(query, k_cache[0, :, 0].expand(len(lens), HKV, D),
                    v_cache[0, :, 0].expand(len(lens), HKV, D), meta)

    longest = int(lens.max())
    nb = -(-longest // bs)
    heads = torch.arange(HKV)
    rows = (torch.from_numpy(table[:, :nb])[:, None, :] * HKV + heads[:, None]).reshape(-1)
    mask = (torch.arange(longest)[None, :] < torch.from_numpy(lens)[:, None])[:, None, None, :]

    def padded() -> torch.Tensor:
        b = len(lens)
        k = k_cache.view(-1, bs, D).index_select(0, rows).view(b, HKV, nb * bs, D)[:, :, :longest]
        v = v_cache.view(-1, bs, D).index_select(0, rows).view(b, HKV, nb * bs, D)[:, :, :longest]
        q = query.view(b, HKV, HQ // HKV, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5).reshape(b, -1)

    return ragged, padded


def _timings(fns: list, rounds: int, clock) -> np.ndarray:
    """``[rounds, len(fns)]`` seconds, the variants interleaved within each round."""
    times = np.zeros((rounds, len(fns)))
    # Every timed call starts from the same cache state: after a pass over a buffer twice
    # the size of the CPU's last-level cache (otherwise a call inherits whatever the
    # previous variant left there, and the batch's K/V fit in a 32 MiB L3 or not).
    flush = torch.zeros(16 << 20)
    for fn in fns:
        fn()  # warm-up
    for r in range(rounds):
        for i, fn in enumerate(fns):  # interleaved: a noisy moment hits every variant
            flush.add_(1.0)
            t = clock()
            fn()
            times[r, i] = clock() - t
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pool-tokens", type=int, default=1 << 17,
                    help="KV pool size in tokens, the same for both batches (default 131072: "
                         "128 MiB of fp32 K/V, far beyond the CPU's caches, as in a serving "
                         "engine; a pool sized to the batch fits a 32 MiB L3 at the base "
                         "batch and not when doubled)")
    args = ap.parse_args()
    # As in raylm's CPU workers: freed activations stay mapped, so no round pays for
    # faulting its pages in again (that noise was larger than the kernels' differences).
    keep_freed_host_memory()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    lens = np.random.default_rng(0).integers(16, 769, args.batch)
    doubled = lens.copy()
    doubled[int(lens.argmax())] *= 2
    print(f"# {args.batch} decode rows, contexts 16-768 (sum {int(lens.sum())}, longest "
          f"{int(lens.max())}); doubled: longest row -> {int(doubled.max())} (sum "
          f"{int(doubled.sum())}, +{100 * (doubled.sum() / lens.sum() - 1):.1f}%); block size "
          f"{args.block_size}, {args.threads} thread(s), "
          f"{'CPU' if args.threads == 1 else 'wall'} ms, min of {args.rounds} rounds")
    print(f"| {'dtype':<9} | {'kernel':<12} | {'ms (base)':>9} | {'ms (doubled)':>12} "
          f"| {'doubling costs':>14} | {'ragged vs padded':>16} |")
    print(f"|{'-' * 11}|{'-' * 14}|{'-' * 11}|{'-' * 14}|{'-' * 16}|{'-' * 18}|")
    bs = args.block_size
    with torch.inference_mode():
        for name in args.dtype.split(","):
            # Every row's partial last block may take a block of its own.
            num_blocks = max(args.pool_tokens // bs, -(-int(doubled.sum()) // bs) + len(lens))
            kv = _kv_pool(num_blocks, bs, getattr(torch, name), 1)
            c0, p0 = _case(lens, bs, 1, True, kv, lens)
            c1, p1 = _case(doubled, bs, 1, True, kv, lens)
            r0, _ = _case(lens, bs, 1, False, kv, lens)
            r1, _ = _case(doubled, bs, 1, False, kv, lens)
            for fn in (c0, r0):
                torch.testing.assert_close(fn().float(), p0().float(), atol=2e-2, rtol=2e-2)
            # Columns: base C++, torch, padded, then the doubled batch's in the same order.
            times = _timings([c0, r0, p0, c1, r1, p1], args.rounds, clock)
            best = times.min(axis=0)
            for i, kernel in enumerate(("ragged C++", "ragged torch", "padded sdpa")):
                # The doubling cost is the median of each round's doubled / base ratio:
                # the two calls of a round ran moments apart, under the same neighbours,
                # where the minima of two columns may come from different moments.
                cost = float(np.median(times[:, i + 3] / times[:, i])) - 1
                vs = f"{best[2] / best[i]:.2f}x faster" if i < 2 else "-"
                print(f"| {name:<9} | {kernel:<12} | {best[i] * 1e3:>9.3f} "
                      f"| {best[i + 3] * 1e3:>12.3f} | {100 * cost:>+13.1f}% | {vs:>16} |",
                      flush=True)


if __name__ == "__main__":
    main()
