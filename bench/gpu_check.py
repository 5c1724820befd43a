"""The one script a GPU machine runs first (at most ~8 minutes on one GPU): the CUDA paths
against transformers, the deployment checks, and the throughput rows.

    python bench/gpu_check.py [--quick]

Needs one CUDA GPU; Ray is needed only for the `raylm serve` check (the engine otherwise
runs in process). Every check prints one line starting with PASS or FAIL; the exit status
is the number of failures. Checkpoints are random-weight Llamas written locally (nothing is
downloaded).

0. versions (torch, CUDA, GPU, transformers, ray if installed);
1. greedy tokens of raylm (sync and async, fp32, chunked prefill) equal transformers'
   `generate` on the same GPU, for several architectures (mixtures of experts among them,
   through the Triton expert kernel; DeepSeek-V3's latent attention through the attention
   kernel's padded head size);
2. the sampled-id copy runs on a copy stream with an event (not the CPU thread);
3. an NCCL process group of one rank: the communicator comes up, all_reduce and broadcast
   on CUDA tensors;
4. bf16: the share of greedy tokens equal to transformers in bf16 (reported, not asserted
   exact: bf16 rounding differs between attention implementations);
5. a checkpoint with 131072 positions starts at that max_model_len on the GPU, and the
   step reserve of Llama-3.1-8B's shape at 131072 leaves a KV cache on this GPU;
6. the async PP ring's communicator order soaked over NCCL with as many ranks as GPUs
   (two at least; with one GPU, over Gloo on the CPU: reported as such);
7. `raylm serve` on the GPU: one request, the device in /metrics, GPU memory in use;
8. the fused MoE Triton kernel against the torch grouped path (bf16, a Qwen3-30B-A3B
   layer's shape): difference and time per call;
8b. the quantized-linear Triton kernel against a bf16 matmul on the dequantized weight
   (a 4-bit 14336 x 4096 layer, 1 and 256 rows): difference, time per call; a Q4_0 GGUF
   kept quantized against the same file dequantized, greedy tokens;
8c. the FP8 Triton kernel (block-wise [128, 128] scales) and the 8-bit kernel at Q6_K's
   group of 16 against a bf16 matmul on the dequantized weight (14336 x 4096, 1 and 256
   rows): difference, time per call;
9. speed (bench/gpu_speed.py): the Triton attention kernel against the torch ragged kernel
   and padded sdpa; CUDA graphs on and off against transformers; steady steps under
   torch's sync-debug mode; one decode step against its memory floor; bf16 throughput of
   raylm async / sync beside transformers' static batching (1B and an 8B-shaped model).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from raylm.runner.loading.checkpoint import SPECS, CheckpointSpec, write_random_checkpoint  # noqa: E402

FAILURES: list[str] = []


def report(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILURES.append(what)


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int, dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    # ignore_eos as raylm's: no EOS id at all. (min_new_tokens would instead mask EOS out
    # of the logits, which raylm's ignore_eos does not do, and the two would part there.)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


def raylm_greedy(path: str, prompts: list[list[int]], max_tokens: int, **kwargs) -> list[list[int]]:
    from raylm import LLM, SamplingParams

    llm = LLM(path, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def prompts_for(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check_correctness(root: str, quick: bool) -> None:
    specs = {
        "llama-gqa": CheckpointSpec(),
        "qwen2": CheckpointSpec(architecture="Qwen2ForCausalLM", seed=2),
        "qwen3": CheckpointSpec(architecture="Qwen3ForCausalLM", head_dim=32,
                                tie_word_embeddings=True, seed=3),
        # Sparse expert MLPs through the Triton kernel (runner/models/fused_moe_triton.py).
        "qwen3-moe": CheckpointSpec(architecture="Qwen3MoeForCausalLM", num_hidden_layers=3,
                                    head_dim=32, mlp_only_layers=(1,), seed=31),
        "mixtral": CheckpointSpec(architecture="MixtralForCausalLM", num_experts=4, seed=35),
        # DeepSeek-V3: absorbed latent attention (one KV head of 48 channels, padded in the
        # Triton kernel, value read from the key cache) and the grouped sigmoid router.
        "deepseek-v3": CheckpointSpec(architecture="DeepseekV3ForCausalLM",
                                      num_hidden_layers=3, seed=41),
        # Sliding windows and capped scores in the Triton kernel: Mistral's window on every
        # layer; Gemma 2's on layers 0 and 2 (their own KV cache group), layer 1 global.
        "mistral-window": CheckpointSpec(architecture="MistralForCausalLM", sliding_window=20,
                                         seed=21),
        "gemma2": CheckpointSpec(architecture="Gemma2ForCausalLM", num_hidden_layers=3,
                                 sliding_window=20, head_dim=32, final_logit_softcapping=30.0,
                                 attn_logit_softcapping=0.5, seed=38),
    }
    if quick:
        specs = {"llama-gqa": specs["llama-gqa"]}
    for name, spec in specs.items():
        path = write_random_checkpoint(os.path.join(root, name), spec)
        prompts = prompts_for(spec.vocab_size, 8, 3, 60, seed=7)
        want = hf_greedy(path, prompts, 24, torch.float32)
        for mode in (False, True):
            got = raylm_greedy(path, prompts, 24, dtype="float32", async_scheduling=mode,
                               max_num_batched_tokens=64)  # 64: long prompts are chunked
            same = sum(a == b for a, b in zip(got, want, strict=True))
            report(same == len(prompts),
                   f"{name} fp32 async={mode}: {same}/{len(prompts)} requests equal transformers")
            for p, a, b in zip(prompts, got, want, strict=True):
                if a != b:
                    print("  " + divergence(path, p, a, b), flush=True)


def check_eagle(root: str) -> None:
    """EAGLE-1 and EAGLE-3 heads drafting on the GPU (the head's pass and chain after each
    verification, drafts on the device until the next step): greedy tokens equal
    transformers', sync and async, and drafts were made."""
    from raylm import LLM, SamplingParams
    from raylm.runner.loading.eagle_checkpoint import write_eagle_head

    path = write_random_checkpoint(os.path.join(root, "eagle-target"),
                                   CheckpointSpec(num_hidden_layers=4, seed=51))
    prompts = prompts_for(512, 6, 3, 60, seed=9)
    want = hf_greedy(path, prompts, 24, torch.float32)
    for method in ("eagle", "eagle3"):
        head = write_eagle_head(os.path.join(root, f"head-{method}"), path, method)
        for mode in (False, True):
            llm = LLM(path, dtype="float32", async_scheduling=mode, max_num_batched_tokens=64,
                      speculative_config={"method": method, "model": head,
                                          "num_speculative_tokens": 3,
                                          "draft_step_overhead_tokens": 1e6})
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)
            drafted = llm.get_metrics()["raylm:spec_decode_num_draft_tokens"]
            llm.shutdown()
            same = sum(o.outputs[0].token_ids == w for o, w in zip(outs, want, strict=True))
            report(same == len(prompts) and drafted > 0,
                   f"{method} async={mode}: {same}/{len(prompts)} requests equal transformers, "
                   f"{drafted:.0f} drafts")


def check_diffusion(root: str) -> None:
    """A diffusion LM (DiffusionGemma) on the GPU: each canvas's first denoising step's
    logits equal transformers' on the same canvas and cache, and a batch (async, its
    canvases through the padded EqualRows sdpa, per-request CUDA generators for seeded
    requests) runs every request to its length with no block left in use."""
    from raylm import LLM, SamplingParams
    from raylm.runner.loading.diffusion_checkpoint import write_random_diffusion_checkpoint
    from raylm.runner.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion as Ours

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = write_random_diffusion_checkpoint(
        os.path.join(root, "dgemma"), canvas_length=4, vocab_size=320, with_tokenizer=True,
        generation={"max_denoising_steps": 6})
    steps = []
    denoise = Ours.denoise

    def recorded(self, ids, positions, meta, *conditioning):
        logits = denoise(self, ids, positions, meta, *conditioning)
        if conditioning and conditioning[0] is None:  # a first step: no self-conditioning
            steps.append((ids.clone(), positions.clone(), logits.clone()))
        return logits

    Ours.denoise = recorded
    try:
        prompt = [5, 17, 42, 9, 61, 33, 70]
        with LLM(path, dtype="float32", block_size=4) as llm:
            llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(seed=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            lengths = [3, 9, 16, 5]
            outs = llm.generate([{"prompt_token_ids": prompt[:n % 7 + 1]} for n in lengths],
                                [SamplingParams(seed=i if i % 2 else None, max_tokens=n,
                                                ignore_eos=True)
                                 for i, n in enumerate(lengths)], use_tqdm=False)
            usage = llm.get_metrics()["raylm:kv_cache_usage_perc"]
    finally:
        Ours.denoise = denoise
    from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

    ids, positions, logits = steps[0]
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).to(device)
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        hf.model.encoder(input_ids=torch.tensor([prompt], device=device), cache=cache,
                         position_ids=torch.arange(len(prompt), device=device)[None])
        ref = hf(decoder_input_ids=ids[None].to(device), cache=cache,
                 decoder_position_ids=positions[None].to(device)).logits[0]
    diff = (ref.float().cpu() - logits.float().cpu()).abs().max().item()
    got = [len(o.outputs[0].token_ids) for o in outs]
    report(diff < 1e-3 and got == lengths and usage == 0.0,
           f"diffusion: first-step logits max diff {diff:.2e} vs transformers, lengths {got} "
           f"(want {lengths}), KV in use after {usage}")


def time_us(fn, calls: int = 20) -> float:
    """Microseconds per call of ``fn`` on the GPU, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def check_quant_linear(root: str) -> None:
    """The Triton quantized linear (runner/quantization/triton_linear.py) on the GPU: a
    4-bit layer of Llama-3-8B's MLP shape (14336 x 4096) against dequantize-then-matmul in
    bf16 at 1 and 256 rows, each path's time per call; then a Q4_0 GGUF of a tiny Llama
    run kept quantized, its greedy tokens against the same file dequantized (fp32)."""
    from raylm.runner.loading.gguf_writer import write_gguf_from_hf
    from raylm.runner.quantization.group_quantized import GroupQuantized
    from raylm.runner.quantization.triton_linear import TritonQuantLinear

    gen = torch.Generator().manual_seed(0)
    n, k = 14336, 4096
    weight = GroupQuantized(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                            torch.rand(n, k // 32, generator=gen) * 0.01,
                            torch.randn(n, k // 32, generator=gen) * 0.01, 4, "Q4")
    layer = TritonQuantLinear(weight, "cuda")
    dense = weight.dequantize(torch.bfloat16).cuda()
    for rows in (1, 256):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        want = (x.float() @ dense.float().t())
        err = ((layer(x).float() - want).abs().max() / want.abs().max()).item()
        times = [time_us(lambda x=x: x @ dense.t()), time_us(lambda x=x: layer(x))]
        report(err < 0.02, f"quantized linear (Triton, 4-bit) vs bf16 matmul, {rows} rows: "
               f"max rel diff {err:.4f}; {times[1]:.0f} us vs {times[0]:.0f} us per call "
               f"({times[0] / times[1]:.2f}x), weight {layer.nbytes() / dense.nbytes():.2f}x "
               "the bf16 bytes")
    spec_path = write_random_checkpoint(os.path.join(root, "q4-base"), CheckpointSpec())
    gguf = write_gguf_from_hf(spec_path, os.path.join(root, "q4", "tiny.Q4_0.gguf"), "Q4_0")
    prompts = prompts_for(512, 8, 3, 60, seed=9)
    quantized = raylm_greedy(os.path.dirname(gguf), prompts, 24, dtype="float32")
    dequantized = raylm_greedy(os.path.dirname(gguf), prompts, 24, dtype="float32",
                               quantization="none")
    same = sum(a == b for a, b in zip(quantized, dequantized, strict=True))
    report(same == len(prompts), f"Q4_0 GGUF kept quantized on the GPU: {same}/{len(prompts)} "
           "requests equal the dequantized run")


def check_fp8_and_q6_k_linears() -> None:
    """The FP8 Triton linear (runner/quantization/triton_fp8_linear.py, block-wise scales)
    and the group-quantized one at Q6_K's group of 16 (8-bit codes) on the GPU, each a
    14336 x 4096 layer against a bf16 matmul on its dequantized weight at 1 and 256 rows."""
    from raylm.runner.quantization.fp8_weight import Fp8Weight
    from raylm.runner.quantization.group_quantized import GroupQuantized
    from raylm.runner.quantization.triton_fp8_linear import TritonFp8Linear
    from raylm.runner.quantization.triton_linear import TritonQuantLinear

    gen = torch.Generator().manual_seed(0)
    n, k = 14336, 4096
    fp8 = Fp8Weight((torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn),
                    torch.rand(n, k // 128, generator=gen) * 1e-3, 128)
    q6 = GroupQuantized(torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen),
                        torch.rand(n, k // 16, generator=gen) * 0.01, torch.zeros(n, k // 16),
                        8, "Q6_K", group_size=16)
    for name, weight, layer in (("FP8 block-wise", fp8, TritonFp8Linear(fp8, "cuda")),
                                ("Q6_K (8-bit, group 16)", q6, TritonQuantLinear(q6, "cuda"))):
        dense = weight.dequantize(torch.bfloat16).cuda()
        for rows in (1, 256):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ dense.float().t()
            err = ((layer(x).float() - want).abs().max() / want.abs().max()).item()
            times = [time_us(lambda x=x, dense=dense: x @ dense.t()),
                     time_us(lambda x=x, layer=layer: layer(x))]
            report(err < 0.02, f"{name} linear (Triton) vs bf16 matmul, {rows} rows: max rel "
                   f"diff {err:.4f}; {times[1]:.0f} us vs {times[0]:.0f} us per call, weight "
                   f"{layer.nbytes() / dense.nbytes():.2f}x the bf16 bytes")


def check_fused_moe() -> None:
    """The Triton expert MLP against the torch grouped path on the GPU, bf16, at a
    Qwen3-30B-A3B layer's shape (hidden 2048, 128 experts of 768, top 8): the largest
    difference relative to the output's scale, and each path's time per call."""
    from raylm.parallel.context import ParallelContext
    from raylm.runner.models.fused_moe_triton import fused_experts
    from raylm.runner.models.moe import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(2048, 768, 128, 8, True, ParallelContext.single("cuda"),
                           torch.bfloat16)
    for p in (block.gate.weight, block.w13, block.w2):
        p.data.normal_(std=0.02)
    for tokens in (1, 256):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        probs = torch.softmax(block.gate(x).float(), dim=-1)
        weights, experts = probs.topk(8, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        counts = torch.bincount(experts.reshape(-1), minlength=128)

        def torch_path(x=x, weights=weights, experts=experts, counts=counts):
            return block.grouped_experts_torch(x, weights, experts, counts)

        def fused(x=x, weights=weights, experts=experts):
            return fused_experts(x, block.w13, block.w2, weights, experts, 0)

        want, got = torch_path().float(), fused().float()
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        times = [time_us(fn) for fn in (torch_path, fused)]
        report(err < 0.02, f"fused MoE (Triton) vs torch grouped, bf16, {tokens} tokens: "
               f"max rel diff {err:.4f}; {times[1]:.0f} us vs {times[0]:.0f} us per call "
               f"({times[0] / times[1]:.2f}x)")


def check_recurrent_kernels() -> None:
    """The recurrent layers' one-token Triton kernels against their torch forms on the GPU,
    float32, at real layers' shapes (Mamba2: Granite 4 / Bamba's 128 heads of 64, 1 group,
    a state of 128; gated delta net: Qwen3-Next's 16 key heads, 32 value heads, 128 x 128),
    64 rows: the largest difference relative to the output's scale, and each path's time
    per call."""
    from raylm.runner.models.gated_delta import gated_delta_step, gated_delta_step_torch
    from raylm.runner.models.ssd import ssd_decode, ssd_decode_torch

    torch.manual_seed(0)
    dev, rows = "cuda", 64

    def r(*shape):
        return torch.randn(*shape, device=dev)

    mamba = (r(rows, 128, 64), r(rows, 128), -torch.rand(128, device=dev), r(rows, 1, 128),
             r(rows, 1, 128), r(128), r(128), r(rows, 128, 64, 128))
    gdn = (r(rows, 16, 128), r(rows, 16, 128), r(rows, 32, 128),
           -torch.rand(rows, 32, device=dev), torch.rand(rows, 32, device=dev),
           r(rows, 32, 128, 128))
    for name, kernel, reference, args in (("Mamba2 state update", ssd_decode, ssd_decode_torch,
                                           mamba),
                                          ("gated delta rule", gated_delta_step,
                                           gated_delta_step_torch, gdn)):
        got, want = kernel(*args), reference(*args)
        err = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                  for a, b in zip(got, want, strict=True))
        times = []
        for fn in (reference, kernel):
            fn(*args)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn(*args)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / 20 * 1e6)
        report(err < 1e-4, f"{name} step (Triton) vs torch, fp32, {rows} rows: max rel diff "
               f"{err:.2e}; {times[1]:.0f} us vs {times[0]:.0f} us per call "
               f"({times[0] / times[1]:.2f}x)")


def divergence(path: str, prompt: list[int], got: list[int], want: list[int]) -> str:
    """Where two greedy runs part, and how close transformers' top two logits are there:
    a gap near fp32 rounding is a tie that any change of summation order may flip."""
    from transformers import AutoModelForCausalLM

    i = next(k for k, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:i]], device="cuda")).logits[0, -1].float()
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    return (f"prompt of {len(prompt)} tokens parts at output {i}: raylm {got[i]} "
            f"(logit {float(logits[got[i]]):.6f}), transformers {want[i]} "
            f"(logit {float(logits[want[i]]):.6f}); transformers' top-2 gap {gap:.2e}")


def check_copy_stream() -> None:
    from raylm.runner.async_output import AsyncOutputCopier

    copier = AsyncOutputCopier(torch.device("cuda"))
    src = torch.arange(1 << 20, device="cuda", dtype=torch.int64)
    handle = copier.start([src * 2])
    kind = type(handle).__name__
    (host,) = handle.wait()
    report(kind == "_CudaCopy" and int(host[-1]) == 2 * ((1 << 20) - 1),
           f"sampled-id copy on a copy stream + event ({kind}), values intact")


def check_nccl() -> None:
    import torch.distributed as dist

    from raylm.parallel.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
    )

    ctx = init_distributed_environment(world_size=1, rank=0,
                                       distributed_init_method="tcp://127.0.0.1:29533",
                                       tensor_parallel_size=1, timeout_s=60)
    try:
        t = torch.full((4,), 3.0, device=ctx.device)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        torch.cuda.synchronize()
        report(dist.get_backend() == "nccl" and t.tolist() == [3.0] * 4,
               f"NCCL group of one rank on {ctx.device}: all_reduce + broadcast")
    finally:
        destroy_distributed_environment()


def check_bf16(root: str) -> None:
    spec = SPECS["6m"]
    path = write_random_checkpoint(os.path.join(root, "bf16-6m"), spec)
    prompts = prompts_for(spec.vocab_size, 8, 8, 64, seed=11)
    want = hf_greedy(path, prompts, 32, torch.bfloat16)
    got = raylm_greedy(path, prompts, 32, dtype="bfloat16")
    total = sum(len(w) for w in want)
    # Tokens equal up to the first divergence of each request (after it, contexts differ).
    agree = 0
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            if x != y:
                break
            agree += 1
    report(agree / total >= 0.5, f"bf16 6m: {agree}/{total} tokens equal transformers bf16 "
                                 f"before the first divergence")


def check_versions() -> None:
    import transformers

    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = "not installed"
    print(f"versions: torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, transformers "
          f"{transformers.__version__}, ray {ray_version}", flush=True)


def check_long_context(root: str) -> None:
    from raylm import LLM, SamplingParams
    from raylm.parallel.context import ParallelContext
    from raylm.runner.memory_budget import GIB, kv_cache_budget_bytes, step_reserve_bytes
    from raylm.scheduler.config.engine_config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    llama31_8b = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                  "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
                  "max_position_embeddings": 131072}
    config = EngineConfig(ModelConfig(model="8b", max_model_len=131072, hf_config=llama31_8b),
                          CacheConfig(), SchedulerConfig(), ParallelConfig())
    reserve = step_reserve_bytes(config, ParallelContext.single("cuda"), 2)
    free, total = torch.cuda.mem_get_info()
    kv = kv_cache_budget_bytes(free - 16 * GIB, total, 0.9, reserve)  # after 16 GiB weights
    tokens = kv // (32 * 2 * 8 * 128 * 2)
    report(tokens >= 131072, f"Llama-3.1-8B shape at 131072 on this GPU: step reserve "
                             f"{reserve / GIB:.2f} GiB, KV for {tokens} tokens")
    path = write_random_checkpoint(os.path.join(root, "long"),
                                   CheckpointSpec(max_position_embeddings=131072))
    llm = LLM(path, dtype="float32", max_num_seqs=8)
    try:
        blocks = llm.llm_engine.core.engine_core.num_kv_blocks
        out = llm.generate([{"prompt_token_ids": [5, 9, 33]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        report(llm.llm_engine.model_config.max_model_len == 131072 and blocks * 16 >= 131072
               and len(out[0].outputs[0].token_ids) == 4,
               f"131072-position checkpoint starts on the GPU: {blocks} KV blocks")
    finally:
        llm.shutdown()


def check_ring_soak(rounds: int) -> None:
    from pp_ring_soak import run_soak

    gpus = torch.cuda.device_count()
    if gpus >= 2:
        result = run_soak(2 if gpus >= 4 else 1, 2, rounds, device="cuda")
    else:  # NCCL takes one rank per GPU: one GPU soaks the order over Gloo only
        print("pp_ring_soak: one GPU, so the ring soaks over Gloo on the CPU (NCCL unrun)",
              flush=True)
        result = run_soak(2, 2, rounds, device="cpu")
    report(result.ok, result.line.removeprefix("PASS ").removeprefix("FAIL "))


def check_serve(root: str) -> None:
    import signal
    import subprocess
    import urllib.request

    try:
        import ray  # noqa: F401
    except ImportError:
        report(False, "raylm serve on the GPU: ray is not installed on this machine")
        return
    path = write_random_checkpoint(os.path.join(root, "serve"), SPECS["6m"])
    port = 8321
    proc = subprocess.Popen([sys.executable, "-m", "raylm.cluster.cli", "serve", path,
                             "--port", str(port), "--served-model-name", "m"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        body = b'{"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0}'
        req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        answer = urllib.request.urlopen(req, timeout=60).read().decode()
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
        device = [line for line in metrics.splitlines() if line.startswith("raylm:device_info")]
        free, total = torch.cuda.mem_get_info()
        report('"completion_tokens":4' in answer.replace(" ", "")
               and any('device_kind="cuda"' in line for line in device),
               f"raylm serve on the GPU: {device}, {(total - free) / 2**30:.1f} GiB of GPU "
               "memory in use")
    except Exception as e:
        report(False, f"raylm serve on the GPU: {e!r}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        for line in out.splitlines():
            if "runs on" in line:
                print("  " + line.strip(), flush=True)


def main() -> int:
    from gpu_speed import speed_checks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="one architecture, throughput on the 6m model only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("FAIL no CUDA device: run this on a GPU machine")
        return 1
    with tempfile.TemporaryDirectory() as root:
        check_versions()
        for check in (lambda: check_correctness(root, args.quick), lambda: check_eagle(root),
                      lambda: check_diffusion(root),
                      check_copy_stream,
                      check_nccl, check_fused_moe, check_recurrent_kernels,
                      lambda: check_quant_linear(root), check_fp8_and_q6_k_linears,
                      lambda: check_bf16(root),
                      lambda: check_long_context(root),
                      lambda: check_ring_soak(100 if args.quick else 500),
                      lambda: check_serve(root),
                      *speed_checks(root, args.quick)):
            try:
                check()
            except Exception as e:  # a crash in one check must not hide the others
                import traceback

                traceback.print_exc()
                report(False, f"{getattr(check, '__name__', 'check')} raised {e!r}")
    print(f"gpu_check: {len(FAILURES)} failed", flush=True)
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
