"""Pictures of the benchmarks' results, for docs/performance.md.

    python bench/serve.py --vllm-python "$VLLM_PYTHON" \\
        --concurrency 1,4,16,64 --plot docs/img/serve
        -> docs/img/serve_concurrency.png, docs/img/serve_ttft.png
    python bench/throughput.py --workloads mixed200,mixed200-bf16,fixed6m,fixed120m,smollm2 \\
        --engines "raylm async" --vllm-python "$VLLM_PYTHON" \\
        --plot docs/img/throughput.png

The scripts call these functions with plain data (tuples, lists, dicts), so a plot can be
redrawn from figures without rerunning a benchmark. matplotlib (in the `dev` extras) is
imported only when a plot is drawn; `require()` lets a script fail before a long run
rather than after it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence


def require() -> None:
    """Exit with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install -e \".[dev]\")") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def sibling(path: str, suffix: str) -> str:
    """``docs/img/serve`` or ``docs/img/serve.png`` + ``ttft`` -> ``docs/img/serve_ttft.png``."""
    base, ext = os.path.splitext(path)
    return f"{base}_{suffix}{ext or '.png'}"


def _color(name: str, order: Sequence[str]) -> str:
    """One colour per engine, the same in every plot: raylm blue-ish, vLLM orange, HF grey."""
    low = name.lower()
    if "vllm" in low:
        return "tab:orange"
    if low.startswith("hf"):
        return "tab:gray"
    if "raylm" in low:
        raylms = [n for n in order if "raylm" in n.lower()]
        return ("tab:blue", "tab:cyan", "tab:purple")[raylms.index(name) % 3]
    return f"C{(order.index(name) + 4) % 10}"


def _save(plt, fig, path: str) -> str:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"plot: wrote {path}", flush=True)
    return path


def _ordered(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def plot_throughput(rows: Sequence[tuple[str, str, float]], path: str,
                    reference: str | None = None, title: str | None = None) -> str:
    """Output tok/s per workload, one bar per engine (bench/throughput.py's rows:
    (workload, engine, tok/s)). Under each workload, every raylm engine's ratio to
    ``reference`` (vLLM-CPU when it ran). Log scale: the workloads differ by 30x."""
    plt = _pyplot()
    workloads = _ordered(w for w, _, _ in rows)
    engines = _ordered(e for _, e, _ in rows)
    rate = {(w, e): v for w, e, v in rows}
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.5),
                           layout="constrained")
    for i, engine in enumerate(engines):
        xs = [j + (i - (len(engines) - 1) / 2) * width for j, w in enumerate(workloads)
              if (w, engine) in rate]
        ys = [rate[w, engine] for w in workloads if (w, engine) in rate]
        bars = ax.bar(xs, ys, width, label=engine, color=_color(engine, engines))
        ax.bar_label(bars, labels=[f"{y:.0f}" for y in ys], fontsize=7, padding=2)
    labels = []
    for w in workloads:
        ratios = [f"{e.replace('raylm ', '')} {rate[w, e] / rate[w, reference]:.2f}x"
                  for e in engines if "raylm" in e.lower() and reference
                  and (w, e) in rate and rate.get((w, reference))]
        labels.append(w + ("\n" + "\n".join(ratios) if ratios else ""))
    ax.set_xticks(range(len(workloads)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("output tokens/s (log scale)")
    suffix = f"; ratios: raylm / {reference}" if reference else ""
    ax.set_title(title or f"Offline throughput (bench/throughput.py){suffix}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    return _save(plt, fig, path)


def plot_serve_concurrency(points: Sequence[tuple[str, str, int, float, float]],
                           path: str) -> str:
    """bench/serve.py's sweep: output tok/s (top) and mean TTFT (bottom) against the
    client's concurrency, one panel per workload, one line per server. ``points``:
    (server, workload, concurrency, output tok/s, mean TTFT ms)."""
    plt = _pyplot()
    workloads = _ordered(p[1] for p in points)
    servers = _ordered(p[0] for p in points)
    levels = sorted({p[2] for p in points})
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.5 * len(workloads), 6.5),
                             squeeze=False, sharex=True, layout="constrained")
    for col, workload in enumerate(workloads):
        for server in servers:
            mine = sorted((c, tok, ttft) for s, w, c, tok, ttft in points
                          if s == server and w == workload)
            if not mine:
                continue
            cs = [c for c, _, _ in mine]
            style = dict(marker="o", label=server, color=_color(server, servers))
            axes[0][col].plot(cs, [t for _, t, _ in mine], **style)
            axes[1][col].plot(cs, [f for _, _, f in mine], **style)
        axes[0][col].set_title(f"{workload}", fontsize=10)
        axes[0][col].set_ylabel("output tokens/s")
        axes[1][col].set_ylabel("mean TTFT (ms)")
        axes[1][col].set_xlabel("requests in flight (client concurrency)")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.suptitle("Serving (bench/serve.py): throughput and TTFT against concurrency",
                 fontsize=11)
    return _save(plt, fig, path)


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``xs``."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def plot_serve_ttft(samples: Mapping[tuple[str, str, int], Sequence[float]], path: str) -> str:
    """Per-request TTFT as a CDF, one panel per (workload, concurrency), one curve per
    server. ``samples``: (server, workload, concurrency) -> TTFT of each request in ms."""
    plt = _pyplot()
    keys = [k for k, v in samples.items() if v]
    workloads = _ordered(w for _, w, _ in keys)
    servers = _ordered(s for s, _, _ in keys)
    levels = sorted({c for _, _, c in keys})
    fig, axes = plt.subplots(len(workloads), len(levels),
                             figsize=(3.6 * len(levels) + 0.5, 3.2 * len(workloads)),
                             squeeze=False, layout="constrained")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda x, _: f"{x:g}")
    for row, workload in enumerate(workloads):
        for col, level in enumerate(levels):
            ax = axes[row][col]
            for server in servers:
                ttfts = samples.get((server, workload, level))
                if not ttfts:
                    continue
                xs, ys = _cdf(ttfts)
                label = (f"{server}: p50 {_quantile(xs, 0.5):.0f}, "
                         f"p99 {_quantile(xs, 0.99):.0f} ms")
                ax.step(xs, ys, where="post", label=label, color=_color(server, servers))
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{workload}, {level} in flight", fontsize=9)
            ax.set_xlabel("TTFT (ms, log scale)", fontsize=8)
            if col == 0:
                ax.set_ylabel("share of requests")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Serving (bench/serve.py): time to first token of each request, CDF",
                 fontsize=11)
    return _save(plt, fig, path)


def plot_roofline(rows: list[dict], bandwidth: float, path: str, title: str) -> str:
    """Achieved (filled) against each component's roofline bound (hollow) at its arithmetic
    intensity, over the bandwidth slope and the best GEMM peak; log-log."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5), layout="constrained")
    xs = [r["intensity"] for r in rows]
    top = max(r["peak"] or 0.0 for r in rows)
    lo, hi = min(xs) / 2, max(xs) * 2
    knee = top / (bandwidth / 1e9)
    ax.plot([lo, knee, max(hi, knee * 2)], [lo * bandwidth / 1e9, top, top], color="gray",
            lw=1, label=f"copy {bandwidth / 1e9:.1f} GB/s, best GEMM {top:.0f} GFLOP/s")
    for i, r in enumerate(rows):
        c = f"C{i}"
        ax.plot([r["intensity"]] * 2, [r["achieved"], r["roofline"]], color=c, lw=1)
        ax.scatter([r["intensity"]], [r["roofline"]], facecolors="none", edgecolors=c)
        ax.scatter([r["intensity"]], [r["achieved"]], color=c,
                   label=f"{r['component']}: {100 * r['of_roofline']:.0f}% of roofline")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _save(plt, fig, path)
