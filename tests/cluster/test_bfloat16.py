"""bfloat16 on CPU against transformers in bfloat16: greedy tokens must be equal.

The float32 equality tests are the oracle's definition; this one checks that raylm's bf16
path (bf16 weights, activations and KV cache; float32 norms, softmax, logits) makes the
same greedy choices as transformers running the same checkpoint in bf16, except at a
near-tie: two correct bf16 implementations round differently, and when transformers' top
two logits are within two bf16 ulps of each other (an exact tie happens: 5.75 vs 5.75)
either choice is right. So: the tokens must be equal up to the first difference, and at
that difference transformers' logit for raylm's token must be within two ulps of its own
choice; the rest of that sequence follows a different prefix and is not compared.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from raylm import LLM, SamplingParams


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bfloat16_greedy_matches_transformers_bfloat16(llama_path, async_scheduling):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.bfloat16).eval()
    llm = LLM(llama_path, dtype="bfloat16", block_size=8, async_scheduling=async_scheduling)
    rng = random.Random(5)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 40, 9)]
    max_tokens = [10, 12, 8, 14]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.shutdown()
    for p, m, out in zip(prompts, max_tokens, outs, strict=True):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        got = out.outputs[0].token_ids
        assert len(got) == m
        diff = next((i for i in range(m) if got[i] != want[i]), None)
        if diff is None:
            continue
        with torch.inference_mode():
            logits = hf(torch.tensor([p + want[:diff]])).logits[0, -1].float()
        top, ours = float(logits[want[diff]]), float(logits[got[diff]])
        ulp = 2.0 ** (math.floor(math.log2(abs(top))) - 7)  # bf16: 8 significant bits
        assert top - ours <= 2 * ulp, (
            f"prompt of {len(p)} tokens, output {diff}: raylm chose {got[diff]} "
            f"(HF logit {ours}) over HF's {want[diff]} ({top}): not a near-tie")
