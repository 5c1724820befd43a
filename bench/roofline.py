"""One engine step of a mixed batch on the default model, against the machine's roofline.

    RAYLM_NUM_THREADS=1 python bench/roofline.py [--prefill 256] [--decode 32]
        [--context 32] [--dtype float32|bfloat16] [--steps 5] [--plot docs/img/roofline_float32.png]

Per component (QKV / O projections, the MLP's gate_up / down, attention, LM head,
sampling): the FLOPs and least bytes of the step (bench/roofline_model.py), the engine's
achieved rate, and the machine's peaks measured here:
- achieved: an in-process ``LLM`` (SmolLM2-135M-Instruct, the default model) holds
  ``--decode`` greedy rows decoding (prompts of ``--context`` tokens); each probe adds one
  request of ``--prefill`` random tokens and ``max_tokens=1``, so one step runs exactly
  the mix. The model's modules are timed in place (their methods wrapped on the worker
  thread); the steps of that exact composition after one warm-up are kept, medians. The
  decode-only steps between the probes get a second table.
- peak: the best of torch's F.linear, raylm's CPU linear and oneDNN's packed linear at
  each component's own matmul shape, in float32 and bfloat16; bandwidth: a large tensor
  copy (read + write). Measured after the engine has shut down, with its thread count.
The layers run eagerly (``RAYLM_CPU_DECODE_LAYER=0``): the per-component timing wraps the
modules that a decode step's fused layers do not call, so the decode-only table measures
the eager layers, not the engine's default decode step.
With one thread (the default here) every time is thread CPU time, with more wall time: on a
shared box wall time mostly measures the neighbours. "fraction" = achieved / GEMM peak;
"BW fraction" = achieved bytes/s / copy bandwidth; "of roofline" = achieved / min(peak,
intensity x bandwidth); "lost" = the component's time minus its time at the roofline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint  # noqa: E402
from roofline_model import (  # noqa: E402
    COMPONENTS,
    ModelShape,
    Step,
    Work,
    gemm_shapes,
    roofline,
    step_work,
)

# Module name (last part) -> (method timed, component).
_TIMED = {"qkv_proj": ("forward", "qkv_proj"), "o_proj": ("forward", "o_proj"),
          "gate_up_proj": ("forward_split", "gate_up_proj"),  # LlamaMLP calls forward_split
          "down_proj": ("forward", "down_proj"), "attn": ("forward", "attention")}
_ELEM = {"float32": 4, "bfloat16": 2}
_COMPONENTS_IN_FORWARD = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attention")


def _clock(threads: int) -> Callable[[], float]:
    return time.thread_time if threads == 1 else time.perf_counter


class StepRecorder:
    """Per engine step: seconds in each component, and the step's composition."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[tuple[int, int, float], dict[str, float]]] = []

    def timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*a, **k):
            t = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.current[name] += self.clock() - t
        return wrapper

    def instrument(self, runner) -> None:
        model = runner.loaded_model
        for name, module in model.named_modules():
            method, component = _TIMED.get(name.rsplit(".", 1)[-1], (None, None))
            if method is not None and component is not None:
                setattr(module, method, self.timed(component, getattr(module, method)))
        model.forward = self.timed("forward", model.forward)
        model.compute_logits = self.timed("lm_head", model.compute_logits)
        runner.sampler = self.timed("sampling", runner.sampler)
        execute = self.timed("step", runner.execute_model)

        def step(so, *a, **k):
            self.current.clear()
            try:
                return execute(so, *a, **k)
            finally:
                self.steps.append((_composition(so), dict(self.current)))
        runner.execute_model = step


def _composition(so) -> tuple[int, int, float]:
    """(prefill tokens, decode rows, mean decode context) of a SchedulerOutput."""
    n = so.num_scheduled_tokens
    prefill = sum(v for v in n.values() if v > 1)
    cached = so.scheduled_cached_reqs
    ctx = [c + 1 for r, c in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
           if n.get(r) == 1]
    return prefill, len(ctx), (sum(ctx) / len(ctx) if ctx else 0.0)


def profile_engine(args: argparse.Namespace, path: str, clock: Callable[[], float]
                   ) -> list[tuple[tuple[int, int, float], dict[str, float]]]:
    """The steps after the warm-up probe: (composition, seconds per component) each."""
    import random

    from raylm import LLM, SamplingParams

    p, d = args.prefill, args.decode
    llm = LLM(path, dtype=args.dtype, max_num_seqs=d + 1, max_model_len=1024,
              max_num_batched_tokens=max(2048, p + d), enable_prefix_caching=False)
    engine = llm.llm_engine
    runner = engine.core.engine_core.executor.worker.model_runner
    rec = StepRecorder(clock)
    rec.instrument(runner)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]}

    rows = SamplingParams(temperature=0.0, max_tokens=1024 - args.context - 1, ignore_eos=True)
    for i in range(d):
        engine.add_request(f"d{i}", prompt(args.context), rows)
    while len(rec.steps) < 2 or rec.steps[-1][0][:2] != (0, d):  # every row decoding
        engine.step(timeout=1.0)
    mark = len(rec.steps)
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(args.steps + 1):  # the first probe is a warm-up
        engine.add_request(f"p{i}", prompt(p), once)
        done = False
        while not done:
            done = any(o.request_id == f"p{i}" and o.finished
                       for o in engine.step(timeout=1.0))
        if i == 0:
            mark = len(rec.steps)
    llm.shutdown()
    return rec.steps[mark:]


def summarize(steps: list[tuple[tuple[int, int, float], dict[str, float]]], prefill: int,
              decode: int) -> tuple[Step, dict[str, float], int] | None:
    """Median seconds per component over the steps of exactly (prefill, decode), with the
    step (its decode rows' mean context) and how many there were; None if there were none."""
    kept = [(c, t) for c, t in steps if c[:2] == (prefill, decode)]
    if not kept:
        return None
    names = (*COMPONENTS, "forward", "step")
    med = {k: statistics.median(t.get(k, 0.0) for _, t in kept) for k in names}
    context = round(statistics.mean(c[2] for c, _ in kept))
    return Step(prefill, decode, context), med, len(kept)


def _best_seconds(fn: Callable[[], object], clock: Callable[[], float],
                  budget: float = 0.3) -> float:
    fn()  # warm-up (oneDNN builds its kernel on the first call)
    best, spent, n = float("inf"), 0.0, 0
    while n < 3 or (spent < budget and n < 50):
        t = clock()
        fn()
        dt = clock() - t
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def gemm_peak(rows: int, k: int, n: int, dtype, clock: Callable[[], float]) -> float:
    """Best FLOP/s of the CPU linears on hand at x[rows, k] W[n, k]^T."""
    import torch
    import torch.nn.functional as F

    from raylm.parallel.layers import linear, pack_cpu_linear_weight

    x = torch.randn(rows, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    packed = pack_cpu_linear_weight(w)
    forms: list[Callable[[], object]] = [lambda: F.linear(x, w), lambda: linear(x, w)]
    if packed is not None:
        forms.append(lambda: linear(x, w, None, packed))
    return 2.0 * rows * k * n / min(_best_seconds(f, clock) for f in forms)


def copy_bandwidth(clock: Callable[[], float], mib: int = 256) -> float:
    """Bytes/s of one large tensor copy (each byte read once and written once)."""
    import torch

    src = torch.ones(mib << 18)  # float32: mib MiB
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), clock, budget=1.0)


def measure_peaks(shapes: dict[str, tuple[int, int, int]], clock: Callable[[], float]
                  ) -> dict[str, dict[str, float]]:
    import torch

    return {name: {comp: gemm_peak(*shape, dtype, clock) for comp, shape in shapes.items()}
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}


def rows_of(work: dict[str, Work], seconds: dict[str, float], peaks: dict[str, float],
            bandwidth: float) -> list[dict]:
    out = []
    for comp in COMPONENTS:
        w, t = work[comp], seconds[comp]
        peak = peaks.get(comp)
        roof = roofline(w, peak, bandwidth)
        achieved = w.flops / t if t else 0.0
        out.append({"component": comp, "gflop": w.flops / 1e9, "mb": w.bytes / 1e6,
                    "intensity": w.intensity, "ms": t * 1e3, "achieved": achieved / 1e9,
                    "peak": peak / 1e9 if peak else None,
                    "fraction": achieved / peak if peak else None,
                    "gbps": w.bytes / t / 1e9 if t else 0.0,
                    "bw_fraction": (w.bytes / t) / bandwidth if t else 0.0,
                    "roofline": roof / 1e9, "of_roofline": achieved / roof if roof else 0.0,
                    "lost_ms": (t - w.flops / roof) * 1e3 if roof else 0.0})
    return out


def print_table(rows: list[dict]) -> None:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    print("| component | GFLOP | MB | FLOP/B | ms | achieved GFLOP/s | peak GFLOP/s | fraction "
          "| GB/s | BW fraction | roofline GFLOP/s | of roofline | lost ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = "-" if r["peak"] is None else f"{r['peak']:.1f}"
        print(f"| {r['component']} | {r['gflop']:.3f} | {r['mb']:.1f} | {r['intensity']:.1f} "
              f"| {r['ms']:.2f} | {r['achieved']:.1f} | {peak} | {pct(r['fraction'])} "
              f"| {r['gbps']:.1f} | {pct(r['bw_fraction'])} | {r['roofline']:.1f} "
              f"| {pct(r['of_roofline'])} | {r['lost_ms']:.2f} |")


def report(shape: ModelShape, step: Step, seconds: dict[str, float], kept: int,
           dtype: str, threads: int, clock: Callable[[], float], bandwidth: float
           ) -> list[dict]:
    """Measure the GEMM peaks at this step's shapes, print its table; the table's rows."""
    peaks = measure_peaks(gemm_shapes(shape, step), clock)
    work = step_work(shape, step, _ELEM[dtype])
    rows = rows_of(work, seconds, peaks[dtype], bandwidth)
    unit = "thread CPU" if threads == 1 else "wall"
    print(f"\n# one engine step: SmolLM2-135M, {dtype}, {step.prefill} prefill tokens + "
          f"{step.decode} decode rows (mean context {step.context}), "
          f"RAYLM_NUM_THREADS={threads}, median of {kept} steps, {unit} time")
    print("# GEMM peaks, GFLOP/s (rows x k x n): " + "; ".join(
        f"{c} {'x'.join(map(str, s))}: fp32 {peaks['float32'][c] / 1e9:.1f}, "
        f"bf16 {peaks['bfloat16'][c] / 1e9:.1f}" for c, s in gemm_shapes(shape, step).items()))
    print_table(rows)
    accounted = sum(seconds[c] for c in COMPONENTS)
    rest = seconds["forward"] - sum(seconds[c] for c in _COMPONENTS_IN_FORWARD)
    host = seconds["step"] - seconds["forward"] - seconds["lm_head"] - seconds["sampling"]
    total = sum(w.flops for w in work.values())
    print(f"step {seconds['step'] * 1e3:.1f} ms: components {accounted * 1e3:.1f}, rest of the "
          f"forward (embedding, norms, RoPE, activation, residuals) {rest * 1e3:.1f}, "
          f"worker-thread host work (inputs, bookkeeping) {host * 1e3:.1f}; "
          f"{total / 1e9:.2f} GFLOP in the step = "
          f"{total / seconds['step'] / 1e9:.1f} GFLOP/s over the whole step")
    worst = max(rows, key=lambda r: r["lost_ms"])
    print(f"largest gap: {worst['component']}, {worst['lost_ms']:.2f} ms over its roofline "
          f"({100 * worst['of_roofline']:.0f}% of it)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=256, help="prefill tokens in the step")
    ap.add_argument("--decode", type=int, default=32, help="decode rows in the step")
    ap.add_argument("--context", type=int, default=32, help="decode rows' prompt tokens")
    ap.add_argument("--dtype", default="float32", choices=list(_ELEM))
    ap.add_argument("--steps", type=int, default=5, help="probe steps timed")
    ap.add_argument("--plot", help="write the roofline plot of the mixed step here (a PNG)")
    args = ap.parse_args()
    if args.prefill < 2 or args.decode < 1:
        ap.error("--prefill must be at least 2 and --decode at least 1")
    if args.plot:
        import plots
        plots.require()
    # The bench's default: one compute thread, timed in its CPU time.
    threads = int(os.environ.setdefault("RAYLM_NUM_THREADS", "1"))
    # Components are timed by wrapping the layers' modules, which a decode step's fused
    # layers (runner/models/fused_decode_layer.py) do not call: the eager layers here.
    os.environ["RAYLM_CPU_DECODE_LAYER"] = "0"
    clock = _clock(threads)
    path = checkpoint("smollm2")
    with open(os.path.join(path, "config.json")) as f:
        shape = ModelShape.from_config(json.load(f))

    steps = profile_engine(args, path, clock)
    mixed = summarize(steps, args.prefill, args.decode)
    if mixed is None:
        raise SystemExit(f"no step ran exactly {args.prefill} prefill tokens + {args.decode} "
                         f"decode rows; seen: {sorted({c[:2] for c, _ in steps})}")
    import torch

    import raylm
    torch.set_num_threads(threads)
    bandwidth = copy_bandwidth(clock)
    print(f"# raylm from {list(raylm.__path__)[0]}; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = report(shape, *mixed, args.dtype, threads, clock, bandwidth)
    # The decode-only steps between the probes, from the same run: the traffic between
    # prefills, and attention without the prefill's share.
    decode = summarize(steps, 0, args.decode)
    if decode is not None:
        report(shape, *decode, args.dtype, threads, clock, bandwidth)
    if args.plot:
        from plots import plot_roofline

        step = mixed[0]
        plot_roofline(rows, bandwidth, args.plot,
                      f"bench/roofline.py: SmolLM2-135M {args.dtype}, {step.prefill} prefill + "
                      f"{step.decode} decode, {threads} thread(s), achieved (filled) vs "
                      "roofline (hollow)")


if __name__ == "__main__":
    main()
