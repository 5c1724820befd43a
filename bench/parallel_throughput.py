"""Offline throughput of tensor / pipeline parallelism through the real engine (``raylm.LLM``).

    python bench/parallel_throughput.py [--size 6m] [--requests 32] [--output-len 64]

Same workload for every configuration (random-weight Llama checkpoint ``--size`` from
runner/loading/checkpoint.py SPECS, 32-token prompts, greedy, ignore_eos):
- TP=1 in process (UniProcExecutor, torch threads = all cores): the reference
- TP=1 on Ray (EngineCore actor + 1 worker actor, 1 torch thread)
- TP=2 on Ray (2 worker actors, 1 torch thread each, all-reduce over gloo)
- PP=2 on Ray (2 stage actors, hidden states over gloo), async scheduling (the default:
  pp + 1 = 3 steps in flight, each request decodes every 2nd step, sampled ids return to
  stage 0 by broadcast) and sync (2 steps in flight, ids sent by the scheduler)
Every parallel run's tokens are checked against the reference run's. On a 2-core box
neither TP nor PP can win: the ranks share the cores the single process already used; TP
adds two gloo all-reduces per layer, PP one hidden-state
send per step and halves each step's batch (the decode cadence). The ratios say what it
costs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Timer, checkpoint, fixed_workload, print_table  # noqa: E402


def run(path: str, wl, **engine_kwargs) -> tuple[float, list[list[int]]]:
    from raylm import SamplingParams
    from raylm.cluster.engine.llm import LLM  # also exported as raylm.LLM once the API lands

    llm = LLM(path, max_num_seqs=len(wl.prompts), enable_prefix_caching=False, **engine_kwargs)
    try:
        prompts = [{"prompt_token_ids": p} for p in wl.prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in wl.max_tokens]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        with Timer() as t:
            outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert sum(map(len, tokens)) == wl.num_output_tokens
    return wl.num_output_tokens / t.seconds, tokens


def _describe_diff(reference: list[list[int]], tokens: list[list[int]]) -> str:
    """Which requests diverge and where. A divergence late in a sequence of a model with
    flat logits (6m: initializer_range 0.05) is a near-tie flipped by another summation
    order (TP shards, or another batch shape when requests arrive at other times)."""
    firsts = [next(j for j, (a, b) in enumerate(zip(r, t, strict=True)) if a != b)
              for r, t in zip(reference, tokens, strict=True) if r != t]
    return (f"{len(firsts)} of {len(tokens)} requests differ from TP=1, first divergence at "
            f"output positions {sorted(firsts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="6m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    import ray

    # Logical CPUs for the EngineCore actor plus up to two 1-CPU workers.
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    path = checkpoint(args.size)
    from raylm.runner.loading.checkpoint import SPECS

    wl = fixed_workload(SPECS[args.size].vocab_size, args.requests, args.prompt_len,
                        args.output_len)
    print(f"model {args.size} ({path}); workload {wl.describe()}; {os.cpu_count()} cores")
    configs = [
        ("TP=1 in process", {"distributed_executor_backend": "uni"}),
        ("TP=1 ray", {"distributed_executor_backend": "ray"}),
        ("TP=2 ray", {"tensor_parallel_size": 2}),
        ("PP=2 ray", {"pipeline_parallel_size": 2}),
        ("PP=2 ray sync", {"pipeline_parallel_size": 2, "async_scheduling": False}),
    ]
    rows, reference = [], None
    for name, kwargs in configs:
        try:
            tok_s, tokens = run(path, wl, **kwargs)
        except Exception as e:  # a configuration that fails: say so, keep the other rows
            print(f"{name}: not run ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            continue
        if reference is None:
            reference = tokens
        same = "same tokens as TP=1" if tokens == reference else _describe_diff(reference, tokens)
        print(f"{name}: {tok_s:.1f} output tok/s ({same})")
        rows.append((wl.name, name, tok_s))
    print()
    print_table(rows, reference="TP=1 in process")
    ray.shutdown()


if __name__ == "__main__":
    main()
