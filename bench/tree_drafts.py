"""Would a static tree of drafts beat the chain on a CPU? The most a tree could gain,
measured against what it must cost, for an EAGLE-3 head on the default model at batch 1.

    RAYLM_NUM_THREADS=1 python bench/tree_drafts.py [--eagle-head DIR] [--prompts 6]
        [--max-tokens 128] [--repeats 3] [--dtype float32]

The smallest tree that is not a chain adds one node to the k = 3 chain: the head's second
choice for the first draft (vLLM's ``speculative_token_tree`` [(0,), (1,), (0, 0),
(0, 0, 0)]). It needs no further head forward (the head's first output already ranks
it), and one more verified position. Its gain: the steps where the first draft is
rejected and the second choice is the target's token, each one token more. Its cost: the
extra verified position, less than what a k = 4 chain adds to a step (one position and
one chained head forward), plus tree attention, which costs nothing here (the bound).

One process runs the k = 3 and the k = 4 chains side by side on the same held-out
instructions (bench/spec_decode.py's smollm2 workload, one request at a time), in turns
after a warm-up. It records the head's top 2 for every first draft (from the head's own
logits) and compares them with the tokens the target emitted. Prints tokens per step and
ms per step of each chain, the tree's most tokens per step, its least cost per step, and
its best speedup over the k = 3 chain: above 1.00 a tree may pay, at or below it cannot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle-head", default=os.path.expanduser("~/.cache/raylm/eagle3-smollm2"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import spec_decode
    import torch

    from raylm import LLM, SamplingParams
    from raylm.runner.models.eagle_head import EagleHead
    from raylm.runner.spec_decode.eagle_proposer import EagleProposer

    # The head's top 2 at each first draft: (request row's history length, top 1, top 2).
    firsts: list[tuple[int, int, int]] = []
    recording = {"on": False}
    next_tokens, step = EagleHead.next_tokens, EagleProposer.step
    calls: list[torch.Tensor] = []

    def ranked(self, hidden):
        if recording["on"] and not calls:
            logits = self.lm_head.compute_logits(self.norm(hidden))
            top = logits.topk(2, dim=-1).indices
            calls.append(top + self.d2t[top])
        return next_tokens(self, hidden)

    def proposing(self, batch, hidden, sampling, wanted):
        calls.clear()
        drafts = step(self, batch, hidden, sampling, wanted)
        if recording["on"] and calls and wanted:
            top = calls[0].tolist()
            firsts.extend((r.num_tokens, *top[i]) for i, r in enumerate(wanted))
        return drafts

    EagleHead.next_tokens, EagleProposer.step = ranked, proposing
    path = checkpoint("smollm2")
    prompts = spec_decode.smollm2_prompts(args.prompts, args.eagle_head)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    llms = {k: LLM(path, max_num_seqs=1, enable_prefix_caching=False, dtype=args.dtype,
                   kv_cache_memory_bytes=512 << 20,
                   speculative_config={"method": "eagle3", "model": args.eagle_head,
                                       "num_speculative_tokens": k})
            for k in (3, 4)}
    seconds = {k: [] for k in llms}
    steps = {k: [] for k in llms}
    outputs: list[list[int]] = []
    for turn in range(args.repeats + 1):
        for k, llm in llms.items():
            recording["on"] = turn == 1 and k == 3
            before = llm.get_metrics()["raylm:num_scheduler_steps"]
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            if recording["on"]:
                outputs = [list(p["prompt_token_ids"]) + list(o.outputs[0].token_ids)
                           for p, o in zip(prompts, outs, strict=True)]
            if turn:
                seconds[k].append(elapsed)
                steps[k].append(llm.get_metrics()["raylm:num_scheduler_steps"] - before)
    recording["on"] = False
    for llm in llms.values():
        llm.shutdown()
    # A first draft predicts the token at its history's length; one request at a time, the
    # records come prompt after prompt: match each to its prompt by the history it followed.
    tokens = args.prompts * args.max_tokens
    first_right = second_right = 0
    request, last_len = 0, -1
    for length, top1, top2 in firsts:
        if length < last_len:
            request += 1
        last_len = length
        truth = outputs[request][length] if length < len(outputs[request]) else None
        first_right += top1 == truth
        second_right += top1 != truth and top2 == truth
    per_step = {k: statistics.median(seconds[k]) / statistics.median(steps[k]) * 1e3
                for k in llms}
    tokens_per_step = {k: tokens / statistics.median(steps[k]) for k in llms}
    # The tree: the k = 3 chain's steps, one token more wherever the second choice was
    # right; its extra position costs less than the k = 4 chain's extra position + forward.
    num_steps3 = statistics.median(steps[3])
    tree_tokens = tokens_per_step[3] + second_right / num_steps3
    extra = max(per_step[4] - per_step[3], 0.0)
    print(f"{args.prompts} instructions x {args.max_tokens} tokens, batch 1, {args.dtype}, "
          f"median of {args.repeats}")
    print("| drafts | tokens/step | ms/step | tokens/s |")
    print("|---|---|---|---|")
    for k in llms:
        print(f"| chain k={k} | {tokens_per_step[k]:.3f} | {per_step[k]:.2f} | "
              f"{tokens_per_step[k] / per_step[k] * 1e3:.1f} |")
    best = tree_tokens / per_step[3] * 1e3
    print(f"| tree (k=3 + a second first draft), at most | {tree_tokens:.3f} | "
          f">= {per_step[3]:.2f} | <= {best:.1f} |")
    print(f"first drafts {len(firsts)}: top 1 right {first_right}, only the second choice "
          f"right {second_right} ({second_right / max(len(firsts), 1):.1%})")
    print(f"a k=4 chain adds {extra:.2f} ms a step; the tree's extra position costs at most "
          f"that, at least 0")
    print(f"tree vs k=3 chain: at most {tree_tokens / tokens_per_step[3]:.3f}x (free extra "
          f"position), {tree_tokens / tokens_per_step[3] * per_step[3] / (per_step[3] + extra):.3f}x "
          f"if it costs what k=4 adds")


if __name__ == "__main__":
    main()
