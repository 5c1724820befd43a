"""Quantized weights: raylm on a GGUF file kept quantized, beside llama.cpp on the same file
and beside raylm with the file dequantized.

    python bench/quant.py --llama-python "$LLAMA_CPP_PYTHON" [--model FILE.gguf]
                          [--streams 8,32] [--parts decode,serve]

``$LLAMA_CPP_PYTHON`` is a Python with ``llama-cpp-python[server]`` installed (it builds
llama.cpp on the machine: ``python -m venv ~/llama && ~/llama/bin/pip install
'llama-cpp-python[server]'``). Default model: the default model's own file,
SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 linears, a Q8_0 embedding tied to the LM head).

decode: batch 1, greedy, 128 tokens from a 20-token prompt, the median of 3 runs after a
warm-up, each engine in a fresh process with its threads on both cores: raylm's offline
``LLM`` quantized (the default) and dequantized (``quantization="none"``) in the default
dtype (bfloat16 where the CPU has AMX/AVX512-BF16), with a 64 MiB KV cache, and
``llama_cpp.Llama`` (n_ctx 512, n_threads = the cores). Memory: the process's peak RSS, and
for raylm the bytes its weights hold (packed codes and scales, and the dense tensors)
against the float32 footprint.

serve: ``raylm serve FILE`` and ``python -m llama_cpp.server`` on 127.0.0.1, one OpenAI
client (/v1/completions, not streamed: llama_cpp.server streams no usage), 64 requests of
48-word text prompts, greedy, up to 128 output tokens, at each --streams level of requests
in flight. EOS ends a request as it would for a user (llama_cpp.server has no ignore_eos,
and ``logit_bias`` costs it a pass in Python over the vocabulary per token), so output
tokens are counted from each response's usage; both engines run the same weights greedily.
llama_cpp.server serves one request at a time. RSS: the server's process tree (raylm's
includes Ray's and Serve's processes).

Where the CPU has no AMX, llama.cpp is built natively (``CMAKE_ARGS="-DGGML_NATIVE=ON"``).
On an Intel CPU with AMX, llama.cpp 0.3.36 built natively crashes in its AMX matmul
(``ggml_backend_amx_mul_mat``, SIGSEGV on the first prompt); the Intel figures in
docs/performance.md use a build without AMX (drop ``-DGGML_AVX_VNNI=ON`` on a CPU without
AVX-VNNI): ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import median_rate, parse_or_run_child, run_fresh  # noqa: E402
from serve import Server, _free_port  # noqa: E402

PROMPT_IDS = list(range(100, 120))
DECODE_TOKENS = 128
# KV cache sizes, so that resident memory compares the engines, not their default caches:
# batch-1 decode holds 512 tokens (llama.cpp's n_ctx below); the server 32 x 256 tokens.
DECODE_KV_BYTES, SERVE_KV_BYTES = 64 << 20, 256 << 20
SERVE_REQUESTS, SERVE_PROMPT_WORDS, SERVE_TOKENS = 64, 48, 128
MODEL_ID = "bench"

LLAMA_DECODE = """
import json, resource, sys, time
from llama_cpp import Llama
path, threads, n, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
def once():
    llm.reset()
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out
rates = []
for i in range(4):
    t = time.perf_counter(); once(); s = time.perf_counter() - t
    if i:
        rates.append(n / s)
rates.sort()
print(json.dumps({"tok_s": rates[1], "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _weight_bytes(model) -> tuple[int, int]:
    """(bytes the model's weights hold, bytes they would hold dense in float32)."""
    held = dense32 = 0
    seen: set[int] = set()
    for module in model.modules():
        packed = getattr(module, "quantized", None)
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            dense32 += p.numel() * 4
            if name == "weight" and packed is not None:
                if id(packed) not in seen:
                    seen.add(id(packed))
                    held += packed.nbytes()
            else:
                held += p.untyped_storage().nbytes()
    return held, dense32


def run_one(args: argparse.Namespace, mode: str) -> dict:
    from raylm import LLM, SamplingParams

    llm = LLM(args.model, quantization="none" if mode == "dequantized" else None,
              async_scheduling=True, max_model_len=512, kv_cache_memory_bytes=DECODE_KV_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT_IDS}
    rate = median_rate(DECODE_TOKENS, 4, lambda: llm.generate([prompt], params,
                                                              use_tqdm=False))
    model = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
    held, dense32 = _weight_bytes(model)
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    return {"tok_s": rate, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "weights_mb": held / 2**20, "dense32_mb": dense32 / 2**20, "tokens": tokens}


def run_llama_decode(python: str, model: str) -> dict:
    out = subprocess.run([python, "-c", LLAMA_DECODE, model, str(os.cpu_count() or 1),
                          str(DECODE_TOKENS), json.dumps(PROMPT_IDS)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- serving ------------------------------------------------------------------------------
def _prompts() -> list[str]:
    import random

    words = ("the river city light stone garden music paper window morning travel story "
             "market winter forest engine letter silver bridge summer ocean school").split()
    rng = random.Random(0)
    return [" ".join(rng.choice(words) for _ in range(SERVE_PROMPT_WORDS))
            for _ in range(SERVE_REQUESTS)]


async def _load(port: int, prompts: list[str], streams: int) -> dict:
    import openai

    limit = asyncio.Semaphore(streams)
    tokens = 0

    async def one(client, prompt: str) -> None:
        nonlocal tokens
        async with limit:
            out = await client.completions.create(
                model=MODEL_ID, prompt=prompt, max_tokens=SERVE_TOKENS, temperature=0)
            tokens += out.usage.completion_tokens

    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench",
                                  max_retries=0, timeout=1800) as client:
        await asyncio.gather(*(one(client, p) for p in prompts[:2]))  # warm-up
        tokens = 0
        t = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        seconds = time.perf_counter() - t
    return {"tok_s": tokens / seconds, "output_tokens": tokens}


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children, now."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            pass
    return total / 1024


def serve_one(name: str, cmd: list[str], port: int, streams: list[int],
              health_path: str = "/health") -> list[dict]:
    log = os.path.join(tempfile.gettempdir(), f"quant-{name.replace(' ', '-')}.log")
    server = Server(cmd, port, dict(os.environ), log, health_path)
    try:
        server.wait_ready()
        rows = []
        for s in streams:
            r = asyncio.run(_load(port, _prompts(), s))
            rows.append({"server": name, "streams": s, **r, "rss_mb": _rss_mb(server.proc.pid)})
            print(f"  {name} at {s} streams: {r['tok_s']:.1f} tok/s", flush=True)
        return rows
    finally:
        server.stop()


def main() -> None:
    from raylm.runner.loading.default_model import resolve_default_model
    from raylm.runner.loading.gguf_checkpoint import find_gguf_file

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model's)")
    parser.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    parser.add_argument("--streams", default="8,32")
    parser.add_argument("--parts", default="decode,serve")
    args = parse_or_run_child(parser, ("quantized", "dequantized"), run_one)
    if args is None:
        return
    if args.model is None:
        folder = resolve_default_model()
        args.model = os.path.join(os.path.dirname(folder), "SmolLM2-135M-Instruct.Q4_1.gguf")
        if not os.path.isfile(args.model):
            raise SystemExit(f"{args.model} is not there; pass --model FILE.gguf")
    if find_gguf_file(args.model) is None:
        raise SystemExit(f"--model {args.model!r} is not a GGUF file")
    parts = args.parts.split(",")
    print(f"model: {args.model}; {os.cpu_count()} cores", flush=True)
    if "decode" in parts:
        rows = {}
        for mode in ("quantized", "dequantized"):
            rows[mode] = run_fresh(__file__, ["--model", args.model, "--one", mode])
            print(f"  raylm {mode}: {rows[mode]['tok_s']:.1f} tok/s", flush=True)
        if args.llama_python:
            rows["llama.cpp"] = run_llama_decode(args.llama_python, args.model)
        q = rows["quantized"]
        print("\nbatch-1 decode (20-token prompt, 128 greedy tokens, median of 3):")
        print("| engine | tok/s | vs llama.cpp | vs raylm dequantized | peak RSS MB | weights MB |")
        print("|---|---|---|---|---|---|")
        for name, r in rows.items():
            vs_l = (f"{r['tok_s'] / rows['llama.cpp']['tok_s']:.2f}x" if "llama.cpp" in rows
                    else "-")
            vs_d = f"{r['tok_s'] / rows['dequantized']['tok_s']:.2f}x"
            weights = f"{r['weights_mb']:.0f}" if "weights_mb" in r else "-"
            print(f"| {'raylm ' + name if name != 'llama.cpp' else name} | {r['tok_s']:.1f} | "
                  f"{vs_l} | {vs_d} | {r['rss_mb']:.0f} | {weights} |")
        print(f"\nraylm quantized weights: {q['weights_mb']:.0f} MB of a {q['dense32_mb']:.0f} MB "
              f"float32 footprint ({q['weights_mb'] / q['dense32_mb']:.2f}x); "
              f"same 128 tokens quantized and dequantized: "
              f"{q['tokens'] == rows['dequantized']['tokens']}")
    if "serve" in parts:
        streams = [int(s) for s in args.streams.split(",")]
        results = []
        for name, extra in (("raylm", []), ("raylm dequantized", ["--quantization", "none"])):
            port = _free_port()
            results += serve_one(name, [sys.executable, "-m", "raylm.cluster.cli", "serve",
                                        args.model, "--port", str(port),
                                        "--served-model-name", MODEL_ID, "--max-num-seqs",
                                        str(max(streams)), "--max-model-len", "512",
                                        "--kv-cache-memory-bytes", str(SERVE_KV_BYTES),
                                        *extra], port, streams)
        if args.llama_python:
            port = _free_port()
            results += serve_one("llama.cpp", [
                args.llama_python, "-m", "llama_cpp.server", "--model", args.model,
                "--model_alias", MODEL_ID, "--host", "127.0.0.1", "--port", str(port),
                "--n_threads", str(os.cpu_count() or 1), "--n_ctx", str(32 * 256)], port, streams,
                "/v1/models")
        ref = {r["streams"]: r["tok_s"] for r in results if r["server"] == "llama.cpp"}
        print(f"\nserved, {SERVE_REQUESTS} requests, up to {SERVE_TOKENS} tokens each:")
        print("| server | streams | output tok/s | output tokens | vs llama.cpp | RSS MB |")
        print("|---|---|---|---|---|---|")
        for r in results:
            vs = f"{r['tok_s'] / ref[r['streams']]:.2f}x" if r["streams"] in ref else "-"
            print(f"| {r['server']} | {r['streams']} | {r['tok_s']:.1f} | "
                  f"{r['output_tokens']} | {vs} | {r['rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
