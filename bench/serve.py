"""Online serving: the Ray Serve OpenAI endpoint under a bounded loopback load, vs offline.

    python bench/serve.py [--model PATH] [--num-requests 64] [--concurrency 32]
                          [--prompt-len 32] [--output-len 64] [--stream-batching-interval-ms MS]

Starts a local Ray + Serve app on 127.0.0.1 (the 6m demo-size Llama unless --model), sends
the workload with the official openai client (streaming completions, token-id prompts, greedy,
ignore_eos, at most --concurrency in flight), and reports vLLM ``bench serve`` metrics:
TTFT (request sent -> first token), TPOT ((e2e - TTFT) / (output tokens - 1), per request),
ITL (gaps between successive streamed chunks), and output throughput. Then runs the same
workload through the offline ``raylm.LLM`` (same max_num_seqs) and prints the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Timer, checkpoint, fixed_workload  # noqa: E402

MODEL_ID = "bench"


@dataclass
class RequestResult:
    ttft: float
    e2e: float
    output_tokens: int
    itls: list[float] = field(default_factory=list)


async def one_request(client, prompt: list[int], max_tokens: int) -> RequestResult:
    start = time.perf_counter()
    last, ttft, itls, tokens = start, None, [], 0
    stream = await client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            if ttft is None:
                ttft = now - start
            else:
                itls.append(now - last)
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert ttft is not None and tokens == max_tokens, (ttft, tokens, max_tokens)
    return RequestResult(ttft, last - start, tokens, itls)


async def run_load(base_url: str, prompts, max_tokens, concurrency: int):
    import openai

    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0,
                                  timeout=600) as client:
        async def bounded(p, m):
            async with limit:
                return await one_request(client, p, m)

        await asyncio.gather(*(bounded(p, m) for p, m in zip(prompts[:4], max_tokens[:4])))  # warm-up
        with Timer() as t:
            results = await asyncio.gather(*(bounded(p, m) for p, m in zip(prompts, max_tokens)))
    return results, t.seconds


def start_server(model: str, max_num_seqs: int, port: int,
                 stream_batching_interval_ms: float | None = None) -> str:
    import ray
    from ray import serve

    from raylm.cluster import build_openai_app

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_openai_app({"llm_configs": [{
        "model_loading_config": {"model_id": MODEL_ID, "model_source": model},
        "engine_kwargs": {"max_num_seqs": max_num_seqs, "enable_prefix_caching": False},
        "deployment_config": {"max_ongoing_requests": max(64, 2 * max_num_seqs)},
        **({} if stream_batching_interval_ms is None else {"experimental_configs": {
            "stream_batching_interval_ms": stream_batching_interval_ms}}),
    }]}), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_server() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def run_offline(model: str, prompts, max_tokens, max_num_seqs: int) -> float:
    from raylm import SamplingParams
    from raylm.cluster.llm import LLM

    llm = LLM(model, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(batch[:4], params[:4], use_tqdm=False)  # warm-up
    with Timer() as t:
        outs = llm.generate(batch, params, use_tqdm=False)
    llm.shutdown()
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == sum(max_tokens), (got, sum(max_tokens))
    return got / t.seconds


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(name: str, values_s: list[float]) -> str:
    ms = sorted(v * 1000 for v in values_s)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return (f"| {name:<5} | {statistics.mean(ms):>9.2f} | {statistics.median(ms):>11.2f} | "
            f"{p99:>8.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 6m random Llama)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--stream-batching-interval-ms", type=float, default=None,
                        help="experimental_configs.stream_batching_interval_ms (default: "
                             "LLMConfig's)")
    args = parser.parse_args()

    model = args.model or checkpoint("6m")
    import json

    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    wl = fixed_workload(vocab, args.num_requests, args.prompt_len, args.output_len)
    print(f"model: {model}")
    print(f"workload: {wl.describe()}; concurrency {args.concurrency} (streaming, openai "
          f"client, loopback); engine max_num_seqs={args.concurrency}, prefix caching off; "
          f"stream_batching_interval_ms="
          f"{'default' if args.stream_batching_interval_ms is None else args.stream_batching_interval_ms}")

    base = start_server(model, args.concurrency, args.port or _free_port(),
                        args.stream_batching_interval_ms)
    try:
        results, seconds = asyncio.run(run_load(base, wl.prompts, wl.max_tokens, args.concurrency))
    finally:
        stop_server()
    out_tokens = sum(r.output_tokens for r in results)
    served = out_tokens / seconds
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    itls = [x for r in results for x in r.itls]

    offline = run_offline(model, wl.prompts, wl.max_tokens, args.concurrency)

    print(f"\nserved: {len(results)} requests, {out_tokens} output tokens in {seconds:.2f} s")
    print(f"| {'ms':<5} | {'mean':>9} | {'median':>11} | {'p99':>8} |")
    print(f"|{'-' * 7}|{'-' * 11}|{'-' * 13}|{'-' * 10}|")
    print(_stats("TTFT", [r.ttft for r in results]))
    print(_stats("TPOT", tpots))
    print(_stats("ITL", itls))
    print(f"\n| {'engine':<30} | {'output tok/s':>12} |")
    print(f"|{'-' * 32}|{'-' * 14}|")
    print(f"| {'served (Ray Serve, streaming)':<30} | {served:>12.1f} |")
    print(f"| {'offline raylm.LLM':<30} | {offline:>12.1f} |")
    print(f"\nserved / offline output throughput: {served / offline:.2f}")


if __name__ == "__main__":
    main()
