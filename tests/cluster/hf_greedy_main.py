"""transformers' greedy ``generate`` (EOS ignored) for a list of prompts, in a process of its
own: ``python hf_greedy_main.py MODEL MAX_TOKENS < prompts.json > reference.json``.

Prompts of equal length run as one batch (no padding: left padding changes fp32 sums, so a
padded batch is not the unpadded run). One torch thread: on a busy 2-core machine two
threads' barriers made each decode step 10x slower, and the pytest process that runs the
engines keeps its own thread setting. Prints, per prompt, the greedy tokens and at each
position transformers' runner-up token and its top-1 minus top-2 logit gap."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM


def main(path: str, max_tokens: int, prompts: list[list[int]]) -> list[dict[str, list]]:
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos
    groups: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        groups[len(p)].append(i)
    result: list[dict[str, list]] = [{} for _ in prompts]
    with torch.inference_mode():
        for idx in groups.values():
            ids = torch.tensor([prompts[i] for i in idx])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, output_logits=True)
            top2 = torch.stack(out.logits, dim=1).float().topk(2, dim=-1)  # [batch, T, 2]
            for row, i in enumerate(idx):
                tokens = out.sequences[row, ids.shape[1]:].tolist()
                assert tokens == top2.indices[row, :, 0].tolist(), "greedy is not the argmax"
                assert len(tokens) == max_tokens, (len(tokens), max_tokens)
                result[i] = {"tokens": tokens, "runner_up": top2.indices[row, :, 1].tolist(),
                             "gaps": (top2.values[row, :, 0] - top2.values[row, :, 1]).tolist()}
    return result


if __name__ == "__main__":
    json.dump(main(sys.argv[1], int(sys.argv[2]), json.load(sys.stdin)), sys.stdout)
