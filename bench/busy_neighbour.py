"""Throughput beside a busy neighbour: one core of the machine taken by another process.

    python bench/busy_neighbour.py [--workloads fixed6m,fixed120m] [--vllm-python "$VLLM_PYTHON"]
                                   [--repeats 3] [--env GOMP_SPINCOUNT=300000 ...]

Each engine (raylm async, and vLLM-CPU when --vllm-python is given) runs each workload of
bench/throughput.py twice in fresh processes: quiet, then with a neighbour process that
spins one core for the whole run (a Python ``while True: pass``; the kernel places it, as
it would a tokenizer, a Ray daemon or a pod under its own limit). Printed: both rates and
busy / quiet. On a 2-core machine the neighbour takes half the CPU, so an engine whose
compute scales with cores keeps about 0.5x; much less means its threads wait on each other.

--env NAME=VALUE sets a variable in raylm's process (e.g. GOMP_SPINCOUNT=300000 restores
libgomp's own default spin, to compare with the wait policy raylm sets).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint  # noqa: E402
from throughput import VLLM, Plan, plans, run_isolated, run_vllm  # noqa: E402


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """A neighbour process that keeps one core busy until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def rate(engine: str, vllm_python: str | None, path: str, plan: Plan,
         repeats: int) -> float | None:
    if engine == VLLM:
        assert vllm_python is not None
        return run_vllm(vllm_python, path, plan, repeats)
    return run_isolated(engine, path, plan, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="fixed6m,fixed120m")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="a variable for raylm's process (repeatable)")
    args = ap.parse_args()
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--env wants NAME=VALUE, got {item!r}")
        os.environ[name] = value
    known = plans(args.workloads.split(","))
    print(f"# {os.cpu_count()} CPUs; neighbour: one spinning process"
          + (f"; raylm env {' '.join(args.env)}" if args.env else ""), flush=True)
    rows = []
    for name in args.workloads.split(","):
        if name not in known:
            raise SystemExit(f"unknown workload {name!r}; known: {', '.join(known)}")
        plan = known[name]
        path = checkpoint(plan.size)
        print(f"# {name}: {plan.workload.describe()}", flush=True)
        for engine in ["raylm async"] + ([VLLM] if args.vllm_python else []):
            quiet = rate(engine, args.vllm_python, path, plan, args.repeats)
            with busy_core():
                busy = rate(engine, args.vllm_python, path, plan, args.repeats)
            if quiet is None or busy is None:
                print(f"  {engine}: failed", flush=True)
                continue
            rows.append((name, engine, quiet, busy))
            print(f"  {engine}: quiet {quiet:.0f} tok/s, busy {busy:.0f} tok/s, "
                  f"busy / quiet {busy / quiet:.2f}", flush=True)
    print()
    print("| workload | engine | quiet tok/s | one core busy tok/s | busy / quiet |")
    print("|---|---|---|---|---|")
    for name, engine, quiet, busy in rows:
        print(f"| {name} | {engine} | {quiet:.0f} | {busy:.0f} | **{busy / quiet:.2f}** |")


if __name__ == "__main__":
    main()
