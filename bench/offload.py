"""The KV offload tier: time to first token of repeated long prompts whose KV does not fit
the device pool, with the host tier (the OffloadingConnector) against without it.

    python bench/offload.py [--size 6m] [--prompts 8] [--rounds 3] [--prompt-len 2048]
                            [--repeats 3]

Workload: --prompts distinct prompts of --prompt-len tokens (random ids, greedy, 2 output
tokens), sent one at a time, round-robin, --rounds times; the device pool holds a quarter
of their KV (so each prompt is evicted before it comes back), the host tier all of it.
The first round computes every prompt in both runs; the mean TTFT of the later rounds is
reported: recomputed from scratch without the tier (the reference), loaded back from
host memory with it. On a CPU both tiers are host memory, so the tier's gain is compute
saved, not device memory: the copies are real, and the figure is what they cost against
recomputing. Each engine runs in a fresh process (in-process executor, float32), the two
alternating --repeats times; the table shows each one's median (a shared 2-core box moves
single runs by a lot).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import CACHE, parse_or_run_child, run_fresh  # noqa: E402

BLOCK = 16


def _checkpoint(size: str) -> str:
    """A random checkpoint of ``size`` whose context holds a 2048-token prompt and more."""
    from raylm.runner.loading.checkpoint import SPECS, write_random_checkpoint

    path = os.path.join(CACHE, f"llama-{size}-ctx4096")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        write_random_checkpoint(path, replace(SPECS[size], max_position_embeddings=4096))
    return path


def run_one(args: argparse.Namespace, offload: bool) -> dict:
    from raylm.cluster.engine.engine_args import EngineArgs
    from raylm.cluster.engine.llm_engine import LLMEngine
    from raylm.scheduler.sampling_params import RequestOutputKind, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    blocks_per_prompt = -(-(args.prompt_len + 2) // BLOCK)
    pool = args.prompts * blocks_per_prompt // 4  # the prompts' KV is 4x the device pool
    kwargs = dict(block_size=BLOCK, num_kv_blocks=pool, max_num_seqs=4, dtype="float32",
                  max_num_batched_tokens=args.prompt_len, max_model_len=args.prompt_len + 64)
    if offload:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"num_cpu_blocks": 2 * args.prompts * blocks_per_prompt}}
    engine = LLMEngine(EngineArgs.from_kwargs(_checkpoint(args.size), **kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    ttfts: list[list[float]] = []
    for r in range(args.rounds):
        ttfts.append([])
        for i, prompt in enumerate(prompts):
            rid = f"{r}-{i}"
            start = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            first = None
            while True:
                outs = engine.step(timeout=60)
                now = time.perf_counter()
                if first is None and any(o.outputs[0].token_ids for o in outs):
                    first = now - start
                if any(o.finished for o in outs):
                    break
            ttfts[-1].append(first)
    metrics = engine.get_metrics()
    engine.shutdown()
    return {"cold": statistics.mean(ttfts[0]),
            "repeat": statistics.mean(t for rnd in ttfts[1:] for t in rnd),
            "hits": metrics.get("raylm:external_prefix_cache_hits", 0),
            "pool_blocks": pool}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="6m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_or_run_child(parser, ("on", "off"), lambda a, mode: run_one(a, mode == "on"))
    if args is None:
        return
    flags = ["--size", args.size, "--prompts", str(args.prompts), "--rounds",
             str(args.rounds), "--prompt-len", str(args.prompt_len)]
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):  # alternating
            runs[mode].append(run_fresh(__file__, ["--one", mode, *flags]))
    off, on = ({key: statistics.median(r[key] for r in runs[mode]) for key in runs[mode][0]}
               for mode in ("off", "on"))
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens, {args.rounds} rounds "
          f"round-robin, one at a time, 2 output tokens, greedy; {args.size} model, float32; "
          f"device pool {off['pool_blocks']} blocks of {BLOCK} (1/4 of the prompts' KV)")
    print(f"| {'engine':<26} | {'cold TTFT (s)':>13} | {'repeat TTFT (s)':>15} | "
          f"{'vs offload off':>14} |")
    print(f"|{'-' * 28}|{'-' * 15}|{'-' * 17}|{'-' * 16}|")
    for name, r in (("raylm, offload off (ref)", off), ("raylm, offload on", on)):
        print(f"| {name:<26} | {r['cold']:>13.3f} | {r['repeat']:>15.3f} | "
              f"{r['repeat'] / off['repeat']:>13.2f}x |")
    print(f"offload on: {on['hits']} prompt tokens loaded from the host tier")


if __name__ == "__main__":
    main()
