"""Sliding-window KV memory: the blocks one long request holds when the blocks behind the
window are freed, beside the same engine keeping every block (the window treated as full
for memory, as before docs/architecture.md §20).

    python bench/window_kv.py [--contexts 4096,16384,32768] [--window 512]

Model: a random Mistral (hidden 64, 2 layers, float32) with `sliding_window` on every layer.
Workload per context C: one request, a prompt of C - 32 tokens and 32 greedy output tokens
(ignore_eos), async scheduling, blocks of 16 tokens, chunked prefill of 512 tokens.
Measured from the engine's own accounting (the KV manager's blocks per request, read after
every allocation): the peak (during the chunked prefill: the window plus the chunks in
flight) and what the request holds at its last decode step; "full" is
what the same request holds when nothing is freed (the keep-every-block run, checked to
equal ceil(C / 16)). The bound column is (window + one block) / C, the issue's target for
the decoding footprint against the full one. Times are wall seconds for the request.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCK = 16
OUTPUT = 32
CHUNK = 512


def _checkpoint(root: str, window: int, max_len: int) -> str:
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    return write_random_checkpoint(os.path.join(root, f"mistral-w{window}"), CheckpointSpec(
        architecture="MistralForCausalLM", sliding_window=window,
        max_position_embeddings=max_len, seed=5))


def _run(path: str, context: int, keep_every_block: bool) -> dict:
    """One request of ``context`` tokens; the blocks it held (peak in prefill, max in decode)."""
    from raylm import LLM, SamplingParams
    from raylm.scheduler.config import engine_config
    from raylm.scheduler.kv.kv_cache_manager import KVCacheManager

    held = {"peak": 0, "decode": 0}
    prompt_len = context - OUTPUT
    allocate = KVCacheManager.allocate_slots

    def counting(self, request, *args, **kwargs):
        out = allocate(self, request, *args, **kwargs)
        blocks = self.req_to_blocks.get(request.request_id, ())
        n = sum(1 for b in blocks if b is not self.null_block)
        if request.num_computed_tokens >= prompt_len:
            held["decode"] = n  # the latest: decoding's steady state once the prefill settles
        held["peak"] = max(held["peak"], n)
        return out

    free_window = engine_config.EngineConfig.kv_free_window
    KVCacheManager.allocate_slots = counting  # type: ignore[method-assign]
    if keep_every_block:
        engine_config.EngineConfig.kv_free_window = property(  # type: ignore[method-assign]
            lambda self: None)
    try:
        with LLM(path, async_scheduling=True, block_size=BLOCK, max_model_len=context,
                 max_num_batched_tokens=CHUNK, max_num_seqs=1,
                 num_kv_blocks=-(-context // BLOCK)) as llm:
            prompt = [(7 * i) % 500 + 3 for i in range(prompt_len)]
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(temperature=0.0, max_tokens=OUTPUT,
                                              ignore_eos=True))
            seconds = time.perf_counter() - t0
    finally:
        KVCacheManager.allocate_slots = allocate  # type: ignore[method-assign]
        engine_config.EngineConfig.kv_free_window = free_window  # type: ignore[method-assign]
    return {**held, "seconds": seconds, "tokens": list(out[0].outputs[0].token_ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as root:
        path = _checkpoint(root, args.window, max(contexts))
        print(f"random Mistral, sliding_window={args.window} on every layer, blocks of "
              f"{BLOCK}, chunk {CHUNK}, one request of C tokens ({OUTPUT} generated)")
        print(f"{'context':>8} {'full':>6} {'peak held':>13} {'decode held':>12} "
              f"{'decode/full':>12} {'bound':>8} {'s window':>9} {'s full':>8} {'same':>5}")
        for c in contexts:
            freed = _run(path, c, keep_every_block=False)
            full = _run(path, c, keep_every_block=True)
            expected_full = -(-c // BLOCK)
            assert full["peak"] == expected_full, (full, expected_full)
            ratio = freed["decode"] / expected_full
            bound = (args.window + BLOCK) / c
            print(f"{c:>8} {expected_full:>6} {freed['peak']:>13} {freed['decode']:>12} "
                  f"{ratio:>12.4f} {bound:>8.4f} {freed['seconds']:>9.1f} "
                  f"{full['seconds']:>8.1f} {str(freed['tokens'] == full['tokens']):>5}")


if __name__ == "__main__":
    main()
