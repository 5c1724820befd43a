"""Structured-output throughput: the cost of grammar bitmasks and deferred sampling.

    python bench/structured.py [--size 6m] [--repeats 3]

Offline raylm (in process), random-weight Llama checkpoint written locally, greedy.
Workloads at batch 1 and batch 32 (``max_num_seqs`` = batch, one prompt of 16 tokens per
request), each with:
- free:  no constraint, 96 output tokens (ignore_eos);
- json:  a JSON schema (an object with an array of 8-12 strings of 4-8 characters and an
         integer), compact whitespace, up to 256 tokens (ends when the object closes);
- regex: ``([a-z]{4,8} ){12,16}[a-z]{4,8}\\.``, up to 256 tokens.
Output tok/s = output tokens produced / wall time (median of --repeats runs after one
warm-up), async scheduling on and off. Constrained outputs stop when their grammar
completes, each request at its own length, so a batch of them drains as they finish; the
reference for each constrained run is therefore the same prompts unconstrained with each
request's max_tokens set to the length its constrained run produced (ignore_eos, same
detokenization): `free@json`, `free@regex`. The ratios are against those; `free` (96
tokens each) is shown as well. The last line compares, at batch 32 with async on, the
JSON-schema rate to `free@json`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "words": {"type": "array", "minItems": 8, "maxItems": 12,
                  "items": {"type": "string", "pattern": "^[a-z]{4,8}$"}},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["words", "count"],
}
REGEX = r"([a-z]{4,8} ){12,16}[a-z]{4,8}\."


def _params(kind: str, lengths: list[int] | None = None):
    from raylm import SamplingParams, StructuredOutputsParams

    if lengths is not None:  # unconstrained, each request as long as a constrained run
        return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    if kind == "free":
        return SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, detokenize=False)
    so = (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if kind == "json"
          else StructuredOutputsParams(regex=REGEX))
    return SamplingParams(temperature=0.0, max_tokens=256, structured_outputs=so)


def measure(llm, vocab: int, batch: int, kind: str, repeats: int,
            lengths: list[int] | None = None) -> tuple[float, list[int]]:
    """(median tok/s, each request's output length in the last run)."""
    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(16)]}
               for _ in range(batch)]
    params = _params(kind, lengths)
    rates = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        got = [len(o.outputs[0].token_ids) for o in outs]
        tokens = sum(got)
        if lengths is not None:
            assert got == lengths, f"free@{kind} batch {batch}: {got} != {lengths}"
        elif kind != "free":
            bad = [o.outputs[0].finish_reason for o in outs if o.outputs[0].finish_reason != "stop"]
            assert not bad, f"{kind} batch {batch}: unfinished outputs {bad}"
        if i:
            rates.append(tokens / seconds)
    rates.sort()
    return rates[len(rates) // 2], got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="6m")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from raylm import LLM

    path = checkpoint(args.size)
    rows: dict[tuple[bool, int, str], float] = {}
    kinds = ("free", "json", "free@json", "regex", "free@regex")
    for async_scheduling in (True, False):
        llm = LLM(path, async_scheduling=async_scheduling, max_num_seqs=32,
                  max_model_len=512)
        vocab = llm.llm_engine.model_config.vocab_size
        try:
            for batch in (1, 32):
                lengths: dict[str, list[int]] = {}
                for kind in kinds:
                    base = kind.removeprefix("free@")
                    rate, lengths[kind] = measure(llm, vocab, batch, base, args.repeats,
                                                  lengths[base] if "@" in kind else None)
                    rows[(async_scheduling, batch, kind)] = rate
                    print(f"async={'on' if async_scheduling else 'off'} batch={batch} "
                          f"{kind}: {rate:.1f} tok/s", flush=True)
        finally:
            llm.shutdown()
    print(f"model {args.size}, greedy; output tok/s (median of {args.repeats})")
    print("| async | batch | " + " | ".join(kinds) + " | json / free@json | regex / free@regex |")
    print("|---" * (len(kinds) + 4) + "|")
    for async_scheduling in (True, False):
        for batch in (1, 32):
            r = {k: rows[(async_scheduling, batch, k)] for k in kinds}
            print(f"| {'on' if async_scheduling else 'off'} | {batch} | "
                  + " | ".join(f"{r[k]:.1f}" for k in kinds)
                  + f" | {r['json'] / r['free@json']:.2f}x | {r['regex'] / r['free@regex']:.2f}x |")
    free, js = rows[(True, 32, "free@json")], rows[(True, 32, "json")]
    print(f"structured: batch32 free={free:.1f} json={js:.1f} ratio={js / free:.2f}")


if __name__ == "__main__":
    main()
