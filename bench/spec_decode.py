"""Speculative decoding: output tok/s and mean acceptance length, speculation off vs ngram
vs a draft model.

    python bench/spec_decode.py [--k 3] [--batches 1,4,32] [--repeats 3]

Workloads (6m-size random-weight Llama checkpoints written locally, greedy, ignore_eos):
- copy: a checkpoint whose attention output is scaled down 250x, so its next token
  depends mostly on the current one and its text soon repeats itself; a random model
  never quotes its prompt, so this one stands in for requests that quote or edit a
  passage. Each prompt is 32 random tokens followed by 96 tokens this model generated from
  them (generated once, before timing), so the continuation quotes the prompt and prompt
  lookup finds it. 128 output tokens.
- miss: the plain random checkpoint (text that almost never repeats): drafts miss, and
  the per-request draft gate turns speculation off for the requests it cannot help.
  32-token prompts, 64 output tokens.
Each batch size b runs b requests at once (max_num_seqs=b). Both methods run with
disable_by_batch_size=8 (--disable-by-batch-size): a step of more requests drafts nothing,
because on this CPU a request's 1 + k verified positions take the attention path of a
prefill chunk (one attention call per request) instead of the batched decode path. Engines run in this process
one after the other, each with a warm-up run; the median of --repeats timed runs is shown.
accept_len is the mean number of tokens a verifying step emits (1 + accepted drafts).
The draft model is a 1-layer random checkpoint with the target's vocabulary (hidden 64):
it predicts neither target, so its row shows what drafting costs when it cannot win and
the draft gate has to switch it off (there is no trained small model to draft with here).
Every run checks that speculation left the tokens unchanged.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import CACHE, checkpoint, median_rate  # noqa: E402


def copy_checkpoint() -> str:
    """The 6m checkpoint with attention output scaled down (see the module docstring)."""
    path = os.path.join(CACHE, "llama-6m-copy")
    weights_file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights_file):
        import shutil

        from safetensors.torch import load_file, save_file

        shutil.copytree(checkpoint("6m"), path, dirs_exist_ok=True)
        weights = load_file(weights_file)
        for name in weights:
            if name.endswith("o_proj.weight"):
                weights[name] = weights[name] * 0.004
        save_file(weights, weights_file, metadata={"format": "pt"})
    return path


def draft_checkpoint() -> str:
    from raylm.runner.checkpoint import SPECS, CheckpointSpec, write_random_checkpoint

    path = os.path.join(CACHE, "llama-draft-1layer")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        write_random_checkpoint(path, CheckpointSpec(
            vocab_size=SPECS["6m"].vocab_size, hidden_size=64, intermediate_size=128,
            num_hidden_layers=1, max_position_embeddings=2048, seed=11))
    return path


def run(path: str, batch: int, prompt_len: int, quote_len: int, out_len: int,
        spec: dict | None, repeats: int) -> tuple[float, float, list[list[int]]]:
    from raylm import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=batch, enable_prefix_caching=False, speculative_config=spec)
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(prompt_len)]}
               for _ in range(batch)]
    if quote_len:  # the model's own continuation becomes part of the prompt
        quoted = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=quote_len,
                                                      ignore_eos=True, detokenize=False),
                              use_tqdm=False)
        prompts = [{"prompt_token_ids": p["prompt_token_ids"] + q.outputs[0].token_ids}
                   for p, q in zip(prompts, quoted, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True,
                            detokenize=False)
    tokens: list[list[int]] = []

    def once() -> None:
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[:] = [o.outputs[0].token_ids for o in outs]
        assert sum(len(t) for t in tokens) == batch * out_len

    rate = median_rate(batch * out_len, repeats + 1, once)
    m = llm.get_metrics()  # (the quoting run drafts too; it is counted in accept_len)
    drafts = m.get("raylm:spec_decode_num_drafts", 0)
    accept_len = 1 + m["raylm:spec_decode_num_accepted_tokens"] / drafts if drafts else 1.0
    llm.shutdown()
    return rate, accept_len, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--batches", default="1,4,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disable-by-batch-size", type=int, default=8,
                    help="speculative_config.disable_by_batch_size (0: never)")
    args = ap.parse_args()
    args.disable_by_batch_size = args.disable_by_batch_size or None
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3, "disable_by_batch_size": args.disable_by_batch_size}
    draft = {"method": "draft_model", "model": draft_checkpoint(),
             "num_speculative_tokens": args.k, "disable_by_batch_size": args.disable_by_batch_size}
    workloads = [("copy", copy_checkpoint(), 32, 96, 128), ("miss", checkpoint("6m"), 32, 0, 64)]
    print(f"| {'workload':<8} | {'batch':>5} | {'off tok/s':>9} | {'ngram tok/s':>11} | "
          f"{'speedup':>7} | {'accept_len':>10} | {'draft tok/s':>11} | {'speedup':>7} | "
          f"{'accept_len':>10} |")
    print(f"|{'-' * 10}|{'-' * 7}|{'-' * 11}|{'-' * 13}|{'-' * 9}|{'-' * 12}|{'-' * 13}|"
          f"{'-' * 9}|{'-' * 12}|")
    batch1 = None
    for name, path, prompt_len, quote_len, out_len in workloads:
        for batch in [int(b) for b in args.batches.split(",")]:
            shape = (path, batch, prompt_len, quote_len, out_len)
            off, _, want = run(*shape, None, args.repeats)
            on, accept_len, got = run(*shape, ngram, args.repeats)
            assert got == want, f"{name} batch {batch}: ngram changed the tokens"
            dm, dm_len, got = run(*shape, draft, args.repeats)
            assert got == want, f"{name} batch {batch}: the draft model changed the tokens"
            print(f"| {name:<8} | {batch:>5} | {off:>9.1f} | {on:>11.1f} | {on / off:>6.2f}x "
                  f"| {accept_len:>10.2f} | {dm:>11.1f} | {dm / off:>6.2f}x | {dm_len:>10.2f} |",
                  flush=True)
            if name == "copy" and batch == 1:
                batch1 = (off, on, accept_len)
    if batch1 is not None:
        off, on, accept_len = batch1
        print(f"spec: batch1 off={off:.1f} ngram={on:.1f} speedup={on / off:.2f}x "
              f"accept_len={accept_len:.2f}")


if __name__ == "__main__":
    main()
