"""The GPU speed checks of bench/gpu_check.py (one CUDA GPU): the Triton attention kernel
against the torch ragged kernel and padded sdpa, one decode step against its memory floor,
steady steps under torch's sync-debug mode, CUDA graphs on and off, and bf16 throughput of
raylm async / sync beside Hugging Face static batching.

    python bench/gpu_speed.py [--quick]        (gpu_check.py runs these too)

Each check prints PASS/FAIL lines through ``gpu_check.report`` and its figures.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_check import hf_greedy, prompts_for, report  # noqa: E402

from raylm.runner.loading.checkpoint import (  # noqa: E402
    SPECS,
    CheckpointSpec,
    write_random_checkpoint,
)

GPU_SPECS = {name: SPECS[name] for name in ("1b", "8b-4l")}


def _time_cuda(fn, repeats: int = 20) -> float:
    """Median seconds of ``fn`` over ``repeats`` CUDA-event-timed calls (after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def _copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_cuda(lambda: dst.copy_(src), repeats=10)


def check_attention_kernels(rows: int = 64, block_size: int = 16) -> None:
    """One layer of Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16)
    over 64 decode rows with contexts drawn from 16-2048: Triton vs torch ragged vs padded
    sdpa, each equal to a float32 reference; then the longest row doubled."""
    from raylm.runner.attention import triton_paged
    from raylm.runner.attention.paged_attention import build_attention_metadata
    from raylm.runner.attention.ragged import ragged_paged_attention

    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    rng = np.random.default_rng(0)
    lens = rng.integers(16, 2049, rows)
    pool = int((-(-lens // block_size)).sum() * 3)
    kc = torch.randn(pool, hkv, block_size, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(rows, hq, d, device="cuda", dtype=dtype)

    def case(lens):
        perm = rng.permutation(pool)
        width = int(-(-lens.max() // block_size))
        table = np.zeros((rows, width), np.int64)
        k = 0
        for i, n in enumerate(lens):
            nb = -(-int(n) // block_size)
            table[i, :nb] = perm[k:k + nb]
            k += nb
        qsl = np.arange(rows + 1)
        slots = torch.zeros(rows, dtype=torch.int64, device="cuda")
        tiles = triton_paged.build_tiles(qsl, lens, table, "cuda")
        ragged = build_attention_metadata(qsl, lens, slots, table, block_size,
                                          cpu_kernel=False).ragged
        return table, tiles, ragged

    def padded_sdpa(table, lens):
        width = table.shape[1] * block_size
        blocks = torch.as_tensor(table, device="cuda")
        k = kc[blocks].permute(0, 2, 1, 3, 4).reshape(rows, hkv, width, d)
        v = vc[blocks].permute(0, 2, 1, 3, 4).reshape(rows, hkv, width, d)
        mask = torch.arange(width, device="cuda")[None, :] < torch.as_tensor(
            lens, device="cuda")[:, None]
        k = k.repeat_interleave(hq // hkv, 1)
        v = v.repeat_interleave(hq // hkv, 1)
        return F.scaled_dot_product_attention(q[:, :, None], k, v,
                                              attn_mask=mask[:, None, None], scale=d ** -0.5)

    scale = d ** -0.5
    table, tiles, ragged = case(lens)
    ref = padded_sdpa(table, lens).float().reshape(rows, hq * d)
    got = triton_paged.paged_attention(q, kc, vc, tiles, scale).float()
    torch_ragged = ragged_paged_attention(q, kc, vc, ragged, scale).float()
    err = max(float((got - ref).abs().max()), float((torch_ragged - ref).abs().max()))
    report(err < 3e-2, f"Triton and torch ragged attention equal padded sdpa on the GPU "
                       f"(bf16, 64 rows, max |diff| {err:.1e})")
    base = {"triton": _time_cuda(lambda: triton_paged.paged_attention(q, kc, vc, tiles, scale)),
            "torch ragged": _time_cuda(lambda: ragged_paged_attention(q, kc, vc, ragged, scale)),
            "padded sdpa": _time_cuda(lambda: padded_sdpa(table, lens))}
    doubled_lens = lens.copy()
    doubled_lens[int(lens.argmax())] *= 2
    table2, tiles2, ragged2 = case(doubled_lens)
    doubled = {"triton": _time_cuda(lambda: triton_paged.paged_attention(q, kc, vc, tiles2,
                                                                        scale)),
               "torch ragged": _time_cuda(lambda: ragged_paged_attention(q, kc, vc, ragged2,
                                                                         scale)),
               "padded sdpa": _time_cuda(lambda: padded_sdpa(table2, doubled_lens))}
    growth = doubled_lens.sum() / lens.sum() - 1
    for name in base:
        print(f"attention {name}: {base[name] * 1e6:.0f} us per layer, doubling the longest "
              f"row (+{growth:.1%} keys): {doubled[name] / base[name] - 1:+.1%}", flush=True)
    speedup = base["torch ragged"] / base["triton"]
    report(speedup >= 3.0, f"Triton kernel {speedup:.1f}x the torch ragged kernel per layer "
                           "at 64 decode rows (target >= 3x)")
    report(doubled["triton"] / base["triton"] - 1 <= max(0.05, growth + 0.02),
           "Triton kernel's cost follows the sum of contexts when one row doubles")


def check_graphs_and_sync(root: str) -> None:
    """Greedy tokens with CUDA graphs and the compiled fused ops on (the default) and off
    (``enforce_eager``) both equal transformers (fp32); then steady steps, plain and with
    speculative decoding, under torch.cuda.set_sync_debug_mode("error"): no step may
    synchronise the device but the designated copy of sampled ids (an event wait on its
    own stream)."""
    from raylm import LLM, SamplingParams

    path = write_random_checkpoint(os.path.join(root, "graphs"), CheckpointSpec(seed=5))
    prompts = prompts_for(512, 12, 3, 40, seed=9)
    want = hf_greedy(path, prompts, 24, torch.float32)
    for eager in (False, True):
        llm = LLM(path, dtype="float32", enforce_eager=eager, max_num_seqs=16)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                    detokenize=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            runner = llm.llm_engine.core.engine_core.executor.worker.model_runner
            graphs = runner.decode_graphs
            replays = graphs.replays if graphs is not None else 0
            compiled = runner.model.model.norm.ops.compiled
        finally:
            llm.shutdown()
        got = [list(o.outputs[0].token_ids) for o in outs]
        same = sum(a == b for a, b in zip(got, want, strict=True))
        report(same == len(prompts) and (replays > 0) != eager and compiled != eager,
               f"CUDA graphs and compiled fused ops {'off' if eager else 'on'}: {same}/"
               f"{len(prompts)} requests equal transformers, {replays} steps replayed as "
               f"graphs, fused ops compiled: {compiled}")
    # Steady steps of plain decoding (graphs), and of speculative decoding: ngram, and a
    # draft model drafting one step ahead (its drafts stay on the device until the
    # verification's one copy).
    specs = {"plain": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3},
             "draft model": {"method": "draft_model", "model": path,
                             "num_speculative_tokens": 3}}
    for name, spec in specs.items():
        llm = LLM(path, dtype="bfloat16", max_num_seqs=32, speculative_config=spec)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                                    detokenize=False)
            # Repeating prompts: ngram lookups find drafts.
            batch = [{"prompt_token_ids": p * 4} for p in prompts_for(512, 32, 8, 8, seed=1)]
            llm.generate(batch, params, use_tqdm=False)  # warm-up: graphs, compiles
            torch.cuda.set_sync_debug_mode("error")
            try:
                outs = llm.generate(batch, params, use_tqdm=False)
                report(all(len(o.outputs[0].token_ids) == 64 for o in outs),
                       f"{name}: steady steps ran under "
                       "torch.cuda.set_sync_debug_mode('error')")
            except Exception as e:
                report(False, f"{name}: a steady step synchronised the device: {e!r}"[:400])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        finally:
            llm.shutdown()


def _launches_per_step(llm, batch: list, params, steps: int) -> tuple[float, float]:
    """(kernel launches, CUDA graph launches) per decode step: a profile of ``batch``
    generated for ``steps`` tokens less one generated for 1 token (the prefill)."""
    from torch.profiler import ProfilerActivity, profile

    from raylm import SamplingParams

    def launches(p) -> tuple[int, int]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(batch, p, use_tqdm=False)
        names = [e.name for e in prof.events()]
        return (sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
                    for n in names), sum(n == "cudaGraphLaunch" for n in names))

    one = launches(SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
    many = launches(params)
    return ((many[0] - one[0]) / (steps - 1), (many[1] - one[1]) / (steps - 1))


def check_decode_floor(root: str) -> None:
    """One decode step at batch 64, contexts ~1024, on the 1B shape: its time against the
    memory floor (weights + KV read once / the device's measured copy bandwidth)."""
    from raylm import LLM, SamplingParams

    spec = GPU_SPECS["1b"]
    path = write_random_checkpoint(os.path.join(root, "floor-1b"), spec)
    bandwidth = _copy_bandwidth()
    llm = LLM(path, dtype="bfloat16", max_num_seqs=64, max_model_len=2048,
              enable_prefix_caching=False)
    try:
        prompts = [{"prompt_token_ids": p} for p in prompts_for(spec.vocab_size, 64, 1000,
                                                                 1000, seed=2)]
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True,
                                                 detokenize=False), use_tqdm=False)
        n_out = 48
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True,
                                             detokenize=False), use_tqdm=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n_out + 1, ignore_eos=True,
                                             detokenize=False), use_tqdm=False)
        step = (time.perf_counter() - start - prefill) / n_out
        kernels, graphs = _launches_per_step(
            llm, prompts[:64], SamplingParams(max_tokens=9, ignore_eos=True,
                                              detokenize=False), 9)
        print(f"decode step 1B, batch 64: {kernels:.0f} kernel launches and {graphs:.1f} "
              "CUDA graph launches per step (profiled)", flush=True)
    finally:
        llm.shutdown()
    head_dim = spec.hidden_size // spec.num_attention_heads
    kv_width = spec.num_key_value_heads * head_dim
    per_layer = (2 * spec.hidden_size * spec.hidden_size + 2 * spec.hidden_size * kv_width
                 + 3 * spec.hidden_size * spec.intermediate_size)
    weights = 2 * spec.vocab_size * spec.hidden_size + spec.num_hidden_layers * per_layer
    kv = 64 * 1024 * spec.num_hidden_layers * 2 * kv_width
    floor = (weights + kv) * 2 / bandwidth
    print(f"decode step 1B bf16, batch 64, contexts ~1024: {step * 1e3:.2f} ms; memory floor "
          f"{floor * 1e3:.2f} ms at {bandwidth / 1e9:.0f} GB/s ({step / floor:.1f}x)", flush=True)
    report(step <= 3 * floor, f"decode step within 3x its memory floor ({step / floor:.1f}x)")


def check_throughput_bf16(root: str, size: str) -> None:
    """256 requests x (128 prompt + 128 output), bf16, greedy, ignore_eos: raylm async,
    raylm sync, and Hugging Face static batching."""
    from transformers import AutoModelForCausalLM

    from raylm import LLM, SamplingParams

    spec = GPU_SPECS[size]
    path = write_random_checkpoint(os.path.join(root, f"tput-{size}"), spec)
    n, plen, out = 256, 128, 128
    prompts = prompts_for(spec.vocab_size, n, plen, plen, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, detokenize=False)
    batch = [{"prompt_token_ids": p} for p in prompts]
    rates = {}
    for mode in (False, True):
        llm = LLM(path, dtype="bfloat16", async_scheduling=mode, max_num_seqs=256,
                  max_num_batched_tokens=8192, enable_prefix_caching=False, max_model_len=1024)
        try:
            llm.generate(batch[:32], params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            rates[mode] = sum(len(o.outputs[0].token_ids) for o in outs) / (
                time.perf_counter() - start)
        finally:
            llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        model.generate(ids[:32], max_new_tokens=8, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=out, min_new_tokens=out, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        hf = n * out / (time.perf_counter() - start)
    del model
    torch.cuda.empty_cache()
    print(f"throughput {size} bf16, {n} x ({plen} + {out}): hf static {hf:.0f}, raylm sync "
          f"{rates[False]:.0f}, async {rates[True]:.0f} tok/s; async/hf "
          f"{rates[True] / hf:.2f}, async/sync {rates[True] / rates[False]:.2f}", flush=True)
    if size == "1b":
        report(rates[True] >= 4 * hf, f"1B: raylm async {rates[True] / hf:.2f}x HF static "
                                      "batching (target >= 4x)")
        report(rates[True] >= 1.15 * rates[False], f"1B: async/sync "
                                                    f"{rates[True] / rates[False]:.2f} "
                                                    "(target >= 1.15)")


CHECKS = ("attention", "graphs", "floor", "throughput")


def speed_checks(root: str, quick: bool) -> list:
    """The checks gpu_check.py runs, as callables."""
    checks = [check_attention_kernels, lambda: check_graphs_and_sync(root),
              lambda: check_throughput_bf16(root, "1b")]
    if not quick:
        checks += [lambda: check_decode_floor(root),
                   lambda: check_throughput_bf16(root, "8b-4l")]
    return checks


if __name__ == "__main__":
    import argparse
    import tempfile

    import gpu_check

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for check in speed_checks(tmp, args.quick):
            check()
    sys.exit(len(gpu_check.FAILURES))
