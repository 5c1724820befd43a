"""Prefix-cache-aware routing against Ray Serve's power of two choices, one client, one trace.

    python bench/routing.py [--requests 256] [--concurrency 16] [--system-prompts 8]
                            [--system-tokens 1500] [--kv-blocks 512] [--runs prefix,pow2,single]

The trace: 8 system prompts of 1500 tokens (random English words, counted with the 6m demo
model's tokenizer), 256 chat requests, each one of the system prompts (seeded choice) and a
user message of 50 tokens (about 65 new tokens with the chat template), 64 output tokens (greedy, ignore_eos), 16 in flight, streamed
through the openai client. Each run starts a local Ray instance of its own and serves the
6m demo checkpoint (the model in the replica, one CPU each) behind the ingress deployment:

  prefix  2 replicas, request_router prefix
  pow2    2 replicas, request_router pow2 (Ray Serve's power of two choices)
  single  1 replica with the KV pool of both: what one cache that saw the whole trace hits

Each replica's KV pool is --kv-blocks blocks of 16 tokens (512: 8 system prompts need 752,
so a replica holds about five next to its running requests): prefix caches fill up, as
they do when many long prefixes share a GPU. Reported per run: the aggregate prefix-cache
hit rate (the engines' own counters, summed over replicas from the ingress's /metrics),
mean / p50 / p90 TTFT, output tokens per second; then prefix against single and pow2, with
the targets of issue 28 (hit rate >= 0.9 of single's, TTFT <= 0.6 x pow2's, throughput >=
1.0 x pow2's). On a shared 2-core box the TTFT and throughput figures are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint  # noqa: E402

MODEL_ID = "bench"
WORDS = ("the of and to in is was for on that with as by at from his her are an be this "
         "which or had it not were but have all their they one been has more when would who "
         "will there can no if so than into time only some could these two may first then "
         "do any like my now over such our man me even most made after also did many").split()


def _text(rng: random.Random, tok, num_tokens: int) -> str:
    """Random words of WORDS, as many as make ``num_tokens`` tokens."""
    words: list[str] = []
    while len(tok(" ".join(words), add_special_tokens=False).input_ids) < num_tokens:
        words += [rng.choice(WORDS) for _ in range(16)]
    while len(tok(" ".join(words), add_special_tokens=False).input_ids) > num_tokens:
        words.pop()
    return " ".join(words)


def trace(path: str, args: argparse.Namespace) -> list[list[dict[str, str]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    systems = [_text(rng, tok, args.system_tokens) for _ in range(args.system_prompts)]
    return [[{"role": "system", "content": rng.choice(systems)},
             {"role": "user", "content": _text(rng, tok, 50)}]
            for _ in range(args.requests)]


def app_args(path: str, run: str, args: argparse.Namespace) -> dict:
    replicas = 1 if run == "single" else 2
    blocks = args.kv_blocks * (2 if run == "single" else 1)
    return {"llm_configs": [{
        "model_loading_config": {"model_id": MODEL_ID, "model_source": path},
        "engine_kwargs": {"max_model_len": 2048, "max_num_seqs": args.concurrency,
                          "num_kv_blocks": blocks, "distributed_executor_backend": "uni"},
        "deployment_config": {
            "num_replicas": replicas, "max_ongoing_requests": args.concurrency * 2,
            "request_router": {"policy": "prefix" if run == "prefix" else "pow2",
                               "imbalance_threshold": args.imbalance_threshold}}}]}


def engine_counters(base: str) -> dict[str, float]:
    """Prefix-cache queries and hits, summed over the replicas' reports."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    out = {"queries": 0.0, "hits": 0.0, "replicas": 0.0}
    for line in text.splitlines():
        m = re.match(r"raylm:prefix_cache_(queries|hits)_total\{.*replica=.*\} (\S+)$", line)
        if m:
            out[m.group(1)] += float(m.group(2))
            out["replicas"] += m.group(1) == "queries"
    return out


async def client_run(base: str, requests: list, concurrency: int) -> dict:
    import openai

    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(client, messages) -> None:
        nonlocal tokens
        async with sem:
            start = time.perf_counter()
            first = None
            stream = await client.chat.completions.create(
                model=MODEL_ID, messages=messages, max_tokens=64, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
            ttfts.append(first if first is not None else time.perf_counter() - start)

    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                  timeout=900) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, m) for m in requests))
        wall = time.perf_counter() - start
    ttfts.sort()
    return {"ttft_mean": statistics.fmean(ttfts), "ttft_p50": ttfts[len(ttfts) // 2],
            "ttft_p90": ttfts[int(len(ttfts) * 0.9)], "tok_s": tokens / wall, "wall": wall,
            "tokens": tokens}


def run_one(run: str, args: argparse.Namespace, requests: list) -> dict:
    import ray
    from ray import serve

    from raylm.cluster import build_openai_app

    path = checkpoint("6m")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_openai_app(app_args(path, run, args)), name="bench", route_prefix="/")
        base = f"http://127.0.0.1:{args.port}"
        # Warm up every replica with prompts that share nothing with the trace.
        warm = [[{"role": "user", "content": f"warm up {i}"}] for i in range(8)]
        asyncio.run(client_run(base, warm, 8))
        time.sleep(3)  # the replicas report every second
        before = engine_counters(base)
        result = asyncio.run(client_run(base, requests, args.concurrency))
        time.sleep(3)
        after = engine_counters(base)
        queries = after["queries"] - before["queries"]
        result["hit_rate"] = (after["hits"] - before["hits"]) / queries if queries else 0.0
        result["replicas"] = after["replicas"]
        return result
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--kv-blocks", type=int, default=512, help="KV blocks per replica")
    parser.add_argument("--imbalance-threshold", type=float, default=8)
    parser.add_argument("--runs", default="prefix,pow2,single")
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    requests = trace(checkpoint("6m"), args)
    print(f"trace: {args.requests} chats, {args.system_prompts} system prompts of "
          f"{args.system_tokens} tokens, user messages of 50, 64 output tokens, "
          f"{args.concurrency} in flight; KV pool {args.kv_blocks} blocks x 16 tokens per "
          "replica (single: both pools in one)", flush=True)
    results = {}
    for run in args.runs.split(","):
        results[run] = r = run_one(run, args, requests)
        print(f"{run:>6}: {int(r['replicas'])} replica(s), prefix hit rate {r['hit_rate']:.3f}, "
              f"TTFT mean {r['ttft_mean']:.3f} s (p50 {r['ttft_p50']:.3f}, p90 "
              f"{r['ttft_p90']:.3f}), output {r['tok_s']:.1f} tok/s ({r['tokens']} tokens "
              f"in {r['wall']:.1f} s)", flush=True)
    print()
    print("| run | replicas | prefix hit rate | mean TTFT (s) | p90 TTFT (s) | output tok/s |")
    print("|---|---|---|---|---|---|")
    for run, r in results.items():
        print(f"| {run} | {int(r['replicas'])} | {r['hit_rate']:.3f} | {r['ttft_mean']:.3f} | "
              f"{r['ttft_p90']:.3f} | {r['tok_s']:.1f} |")
    prefix, pow2, single = (results.get(k) for k in ("prefix", "pow2", "single"))
    if prefix and single:
        ratio = prefix["hit_rate"] / single["hit_rate"] if single["hit_rate"] else float("nan")
        print(f"prefix hit rate / single replica's: {ratio:.2f} (target >= 0.9)")
    if prefix and pow2:
        print(f"prefix mean TTFT / pow2's: {prefix['ttft_mean'] / pow2['ttft_mean']:.2f} "
              "(target <= 0.6)")
        print(f"prefix output throughput / pow2's: {prefix['tok_s'] / pow2['tok_s']:.2f} "
              "(target >= 1.0)")


if __name__ == "__main__":
    main()
