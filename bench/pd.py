"""Prefill/decode disaggregation against two colocated replicas: decode TPOT p99 and output
throughput under long prompts that arrive while other requests decode.

    python bench/pd.py [--size 6m] [--duration 40] [--decode-rate 4] [--long-rate 0.5]

Workload (open loop, the same seeded arrival schedule for both): short requests (32-token
prompts, 64 output tokens) at --decode-rate per second and long ones (1536-token prompts,
16 output tokens) at --long-rate per second, for --duration seconds; greedy, ignore_eos.
Two engines either way, each one worker actor on one core (one torch thread):
- colocated (the reference): two replicas, requests round-robin between them; a long
  prompt runs in the same steps as the other requests' decodes and stalls them;
- PD: a prefill engine and a decode engine (the RayKVConnector, the KV pulled through
  Ray's object store) behind ``PDEngineClient``, the Serve PD app's proxy logic.
The same asyncio client drives both (no HTTP). TPOT of a request: (last token time - first
token time) / (tokens - 1); p99 over the requests with more than one token. Output
throughput: output tokens / (last finish - first arrival). Each configuration runs in a
fresh process with a Ray instance of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint, parse_or_run_child, run_fresh  # noqa: E402

SHORT, LONG = (32, 64), (1536, 16)  # (prompt tokens, output tokens)


def schedule(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt, max_tokens), seeded: Poisson arrivals of both kinds."""
    rng = random.Random(0)
    out = []
    for rate, (plen, olen) in ((args.decode_rate, SHORT), (args.long_rate, LONG)):
        t = rng.expovariate(rate)
        while t < args.duration:
            out.append((t, [rng.randrange(10, 4000) for _ in range(plen)], olen))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda x: x[0])


def _engines(args: argparse.Namespace, pd: bool):
    from raylm.cluster.engine.async_llm import AsyncLLM
    from raylm.cluster.engine.engine_args import EngineArgs
    from raylm.cluster.serve.pd.pd_client import PDEngineClient
    from raylm.cluster.serve.pd.pd_engines import DECODE_KV, PREFILL_KV, DecodeEngine, PrefillEngine

    common = dict(block_size=16, max_num_seqs=64, dtype="float32", max_model_len=2048,
                  distributed_executor_backend="ray")
    path = checkpoint(args.size)
    if not pd:
        return [AsyncLLM(EngineArgs.from_kwargs(path, **common)) for _ in range(2)]
    prefill = AsyncLLM(EngineArgs.from_kwargs(path, kv_transfer_config=PREFILL_KV, **common))
    decode = AsyncLLM(EngineArgs.from_kwargs(path, kv_transfer_config=DECODE_KV, **common))
    client = PDEngineClient(decode.model_config, decode.tokenizer, PrefillEngine(prefill),
                            DecodeEngine(decode))
    client.owned = [prefill, decode]  # type: ignore[attr-defined]
    return [client]


async def drive(engines: list, plan) -> list[tuple[float, float, float, int]]:
    """Send the schedule round-robin; (arrival, first token, last token, tokens) each."""
    from raylm.cluster.engine.processor import ValidatedPrompt
    from raylm.scheduler.sampling_params import RequestOutputKind, SamplingParams

    start = time.perf_counter()

    async def one(i: int, at: float, prompt: list[int], max_tokens: int):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        arrival = time.perf_counter() - start
        first = last = None
        n = 0
        async for out in engines[i % len(engines)].generate(
                ValidatedPrompt(None, prompt, params), f"r{i}"):
            got = len(out.outputs[0].token_ids)
            if got:
                now = time.perf_counter() - start
                first = now if first is None else first
                last, n = now, n + got
        return arrival, first, last, n

    return await asyncio.gather(*(one(i, *req) for i, req in enumerate(plan)))


def run_one(args: argparse.Namespace, pd: bool) -> dict:
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    engines = _engines(args, pd)
    try:
        results = asyncio.run(drive(engines, schedule(args)))
    finally:
        for e in engines:
            for owned in getattr(e, "owned", [e]):
                owned.shutdown()
        ray.shutdown()
    tpots = sorted((last - first) / (n - 1) for _, first, last, n in results if n > 1)
    tokens = sum(n for *_, n in results)
    span = max(last for _, _, last, _ in results) - min(a for a, *_ in results)
    return {"tpot_p99": tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
            "tpot_p50": tpots[len(tpots) // 2], "throughput": tokens / span,
            "requests": len(results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="6m")
    for flag, default, what in (("--duration", 40.0, "seconds of arrivals"),
                                ("--decode-rate", 4.0, "short requests per second"),
                                ("--long-rate", 0.5, "long prompts per second")):
        parser.add_argument(flag, type=float, default=default, help=what)
    args = parse_or_run_child(parser, ("pd", "colocated"),
                              lambda a, mode: run_one(a, mode == "pd"))
    if args is None:
        return
    flags = ["--size", args.size, "--duration", str(args.duration), "--decode-rate",
             str(args.decode_rate), "--long-rate", str(args.long_rate)]
    res = {mode: run_fresh(__file__, ["--one", mode, *flags]) for mode in ("colocated", "pd")}
    ref = res["colocated"]
    print(f"workload: {ref['requests']} requests over {args.duration:g} s: "
          f"{SHORT[0]}-token prompts + {SHORT[1]} output tokens at {args.decode_rate:g}/s, "
          f"{LONG[0]}-token prompts + {LONG[1]} output tokens at {args.long_rate:g}/s; "
          f"{args.size} model, float32, 2 engines of one worker (one core) each")
    print(f"| {'engine':<30} | {'TPOT p50 (ms)':>13} | {'TPOT p99 (ms)':>13} | "
          f"{'p99 vs ref':>10} | {'output tok/s':>12} | {'vs ref':>7} |")
    print(f"|{'-' * 32}|{'-' * 15}|{'-' * 15}|{'-' * 12}|{'-' * 14}|{'-' * 9}|")
    for name, r in (("raylm, 2 colocated (ref)", ref), ("raylm, PD 1 prefill + 1 decode",
                                                        res["pd"])):
        print(f"| {name:<30} | {1e3 * r['tpot_p50']:>13.1f} | {1e3 * r['tpot_p99']:>13.1f} | "
              f"{r['tpot_p99'] / ref['tpot_p99']:>9.2f}x | {r['throughput']:>12.1f} | "
              f"{r['throughput'] / ref['throughput']:>6.2f}x |")


if __name__ == "__main__":
    main()
