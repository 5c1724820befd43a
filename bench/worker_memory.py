"""Where a CPU worker's memory goes as its steps vary: the anonymous RSS (the heap) of an
in-process engine driven through rounds of requests with random prompt and output lengths,
so that the tokens per step take many values, as under the chaos soak's traffic.

    python bench/worker_memory.py [--rounds 16] [--model tiny]

Four modes, each in a fresh process (the caches are sized at their first primitive):
  uncapped      CPU linears over oneDNN-packed weights, oneDNN's and ideep's primitive
                caches at their default 1024 entries each (ONEDNN_PRIMITIVE_CACHE_CAPACITY,
                LRU_CACHE_CAPACITY): raylm before it capped them
  raylm         as raylm runs: the caches capped at runner/host_memory.py's 128
  small-caches  capped at 8
  mkl           linears over MKL's GEMM (RAYLM_CPU_PACK_LINEARS=0): no oneDNN primitives
Each prints its heap after every round beside the distinct step sizes seen so far and its
time; the last line compares each mode's growth after the first round with uncapped's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

MODES = {
    "uncapped": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"},
    "raylm": {},
    "small-caches": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "8"},
    "mkl": {"RAYLM_CPU_PACK_LINEARS": "0"},
}


def anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_mode(rounds: int, model: str, seed: int = 0) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import checkpoint

    from raylm import LLM, SamplingParams

    llm = LLM(checkpoint(model), num_kv_blocks=512, block_size=16, max_num_seqs=32,
              enable_prefix_caching=False)
    model_ = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
    sizes: set[int] = set()
    forward = model_.forward

    def recorded(input_ids, *args, **kwargs):
        sizes.add(int(input_ids.shape[0]))
        return forward(input_ids, *args, **kwargs)

    model_.forward = recorded
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(seed)
    points = []
    start = time.perf_counter()
    try:
        for _ in range(rounds):
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 240))]
                       for _ in range(32)]
            params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 48),
                                     ignore_eos=True) for _ in prompts]
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            points.append((round(anon_mb(), 1), len(sizes)))
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return {"points": points, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--one", choices=list(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_mode(args.rounds, args.model)))
        return
    print(f"# {args.rounds} rounds of 32 requests (prompts 4-240 tokens, outputs 1-48), "
          f"model {args.model}, one engine in process; heap = RssAnon (MB)")
    growth = {}
    for mode, env in MODES.items():
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--rounds",
                              str(args.rounds), "--model", args.model],
                             env={**os.environ, **env}, capture_output=True, text=True,
                             check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        points = result["points"]
        print(f"{mode:<13} heap by round: " + " ".join(f"{mb:.0f}" for mb, _ in points)
              + f"  ({result['seconds']:.1f} s)")
        print(f"{'':<13} step sizes:    " + " ".join(str(n) for _, n in points))
        growth[mode] = points[-1][0] - points[0][0]
    ref = growth["uncapped"]
    print("growth after round 1 (MB): " + ", ".join(
        f"{m} {g:+.0f} ({g / ref:.2f}x uncapped's)" if ref > 0 else f"{m} {g:+.0f}"
        for m, g in growth.items()))


if __name__ == "__main__":
    main()
