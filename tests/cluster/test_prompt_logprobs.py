"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log_softmax:
whole prompts, chunked prefill, prefix-cache hits, preemption, sync and async."""

from __future__ import annotations

import random

import pytest

from raylm import LLM, SamplingParams

ASYNC_MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def _check(out, prompt: list[int], ref, k: int) -> None:
    """``ref`` [T, vocab]: transformers' log_softmax at every position of ``prompt``."""
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        entry, row, token = plp[pos], ref[pos - 1], prompt[pos]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4, (pos, token)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(top) <= set(entry) and len(entry) <= k + 1
        for r, tid in enumerate(top, start=1):
            assert abs(entry[tid].logprob - row[tid].item()) < 1e-4
            assert entry[tid].rank == r or tid == token


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_prompt_logprobs_match_transformers(llama_path, hf_oracle, async_scheduling):
    # Budget 24 tokens: the 70-token prompts are computed in chunks; 24 blocks of 4 tokens
    # cannot hold all requests at full length, so some are preempted and recomputed.
    llm = LLM(llama_path, async_scheduling=async_scheduling, block_size=4, num_kv_blocks=48,
              max_num_batched_tokens=24, max_num_seqs=6)
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (30, 5, 17)]
    prompts += [[rng.randrange(3, 512) for _ in range(n)] for n in (2, 1, 61)]
    oracle = hf_oracle(llama_path)
    try:
        # Warm the prefix cache with the shared prefix, without prompt logprobs.
        llm.generate([{"prompt_token_ids": shared + [7, 8]}],
                     SamplingParams(temperature=0, max_tokens=1))
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, prompt_logprobs=k)
                  for m, k in zip((20, 9, 14, 3, 5, 12), (0, 3, 5, 1, 2, 4), strict=True)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for p, sp, out in zip(prompts, params, outs, strict=True):
            _check(out, p, oracle.logprobs(p), sp.prompt_logprobs)
            assert out.outputs[0].token_ids == oracle.greedy(p, sp.max_tokens)
        # Prompt logprobs were owed from position 0, so no block of theirs came from the
        # cache; the request without prompt logprobs does hit it.
        assert all(o.num_cached_tokens == 0 for o in outs)
        again = llm.generate([{"prompt_token_ids": prompts[0]}],
                             SamplingParams(temperature=0, max_tokens=2))[0]
        assert again.num_cached_tokens >= 40 and again.prompt_logprobs is None
        m = llm.get_metrics()
        assert m["raylm:num_preemptions"] > 0, m
        assert m["raylm:kv_cache_usage_perc"] == 0.0
    finally:
        llm.shutdown()


def test_prompt_logprobs_with_n_and_validation(llama_path, hf_oracle):
    with LLM(llama_path) as llm:
        prompt = [5, 9, 200, 31, 77]
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(n=2, max_tokens=3, prompt_logprobs=2, seed=1))[0]
        _check(out, prompt, hf_oracle(llama_path).logprobs(prompt), 2)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.generate(["hi"], SamplingParams(prompt_logprobs=21))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
