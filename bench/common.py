"""Shared helpers for the benchmarks: checkpoints, workloads, timing, printing."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from raylm.runner.loading.checkpoint import SPECS, write_random_checkpoint

CACHE = os.environ.get("RAYLM_BENCH_CACHE", os.path.expanduser("~/.cache/raylm/bench"))


def checkpoint(size: str) -> str:
    if size == "smollm2":  # the real default model, fetched once into RAYLM_CACHE_DIR
        from raylm.runner.loading.default_model import resolve_default_model

        return resolve_default_model()
    path = os.path.join(CACHE, f"llama-{size}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        write_random_checkpoint(path, SPECS[size])
    return path


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def describe(self) -> str:
        p = [len(x) for x in self.prompts]
        return (f"{self.name}: {len(p)} requests, prompt {min(p)}-{max(p)} tokens, "
                f"output {min(self.max_tokens)}-{max(self.max_tokens)} tokens, greedy, ignore_eos")


def fixed_workload(vocab: int, n: int, prompt_len: int, out_len: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(n)]
    return Workload(f"fixed{n}x{prompt_len}+{out_len}", prompts, [out_len] * n)


def mixed_workload(vocab: int, n: int, seed: int = 1) -> Workload:
    """Prompts 8-256 and outputs 8-128 tokens: where continuous batching matters."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(8, 256))] for _ in range(n)]
    return Workload(f"mixed{n}", prompts, [rng.randint(8, 128) for _ in range(n)])


def mixed_traffic_workload(vocab: int, n: int = 200, seed: int = 2) -> Workload:
    """Prompts 16-512 and outputs 16-256 tokens (uniform, seeded): mixed-length traffic
    for a batch of up to 256 sequences of at most 1024 tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 512))]
               for _ in range(n)]
    return Workload(f"mixed{n}", prompts, [rng.randint(16, 256) for _ in range(n)])


def ranged_workload(name: str, vocab: int, n: int, prompts: tuple[int, int],
                    outputs: tuple[int, int], seed: int = 3) -> Workload:
    """``n`` requests of random tokens with prompt and output lengths uniform in the
    given inclusive ranges (seeded)."""
    rng = random.Random(seed)
    return Workload(name, [[rng.randrange(10, vocab) for _ in range(rng.randint(*prompts))]
                           for _ in range(n)],
                    [rng.randint(*outputs) for _ in range(n)])


_CHAT_TOPICS = ("the sea", "a CPU", "Paris", "photosynthesis", "a bicycle", "rain", "chess",
                "the moon", "bread", "a violin", "volcanoes", "a library", "gravity", "tea")


def chat_workload(path: str, n: int, seed: int = 2) -> Workload:
    """Chat-templated prompts of mixed lengths (one to eight instructions) and outputs of
    16-128 tokens, for a real instruct model at ``path``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        asks = [f"Tell me about {rng.choice(_CHAT_TOPICS)}." for _ in range(rng.randint(1, 8))]
        ids = tok.apply_chat_template([{"role": "user", "content": " ".join(asks)}],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        prompts.append(list(ids))
    return Workload(f"chat{n}", prompts, [rng.randint(16, 128) for _ in range(n)])


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def median_rate(num_tokens: int, runs: int, fn) -> float:
    """Tokens/s of ``fn`` over ``runs`` calls, the first a warm-up; the median of the rest
    (a small box shared with other work is noisy: single runs move by a lot)."""
    rates = []
    for i in range(runs):
        with Timer() as t:
            fn()
        if i:
            rates.append(num_tokens / t.seconds)
    rates.sort()
    return rates[len(rates) // 2]


def print_table(rows: list[tuple[str, str, float]], reference: str) -> None:
    """rows: (workload, engine, tok/s); ratios against ``reference`` per workload."""
    ref = {w: v for w, e, v in rows if e == reference}
    print(f"| {'workload':<22} | {'engine':<24} | {'output tok/s':>12} | {'vs ' + reference:>16} |")
    print(f"|{'-' * 24}|{'-' * 26}|{'-' * 14}|{'-' * 18}|")
    for w, e, v in rows:
        ratio = f"{v / ref[w]:.2f}x" if ref.get(w) else "-"
        print(f"| {w:<22} | {e:<24} | {v:>12.1f} | {ratio:>16} |")


def run_fresh(script: str, args: list[str]) -> dict:
    """``script`` run with ``args`` in a fresh process (a process's first torch thread runs
    CPU ops faster than later ones, so engines never share one); its last stdout line,
    parsed as JSON."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_or_run_child(parser: argparse.ArgumentParser, modes: tuple[str, ...],
                       run) -> argparse.Namespace | None:
    """The parsed args, or None in a child process started by ``run_fresh`` with
    ``--one MODE``: it has run ``run(args, MODE)`` and printed the result as JSON."""
    parser.add_argument("--one", choices=modes, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is None:
        return args
    print(json.dumps(run(args, args.one)))
    return None
