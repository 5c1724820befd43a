"""Features that meet in one step: prompt logprobs with speculative decoding and with a
grammar-constrained request in the batch, and all three together."""

from __future__ import annotations

import re

import pytest

from raylm import LLM, SamplingParams, StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def _check_prompt_logprobs(out, prompt: list[int], ref) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        token = prompt[pos]
        assert abs(plp[pos][token].logprob - ref[pos - 1][token].item()) < 1e-4, (pos, token)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_with_speculative_decoding(llama_path, hf_oracle, async_scheduling):
    prompt = [5, 9, 14, 5, 9, 14, 5, 9, 14, 22, 31]  # repeats: prompt lookup drafts
    llm = LLM(llama_path, async_scheduling=async_scheduling, speculative_config=NGRAM,
              max_num_batched_tokens=8)  # 8: the prompt is chunked
    try:
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                          prompt_logprobs=1))[0]
    finally:
        llm.shutdown()
    oracle = hf_oracle(llama_path)
    _check_prompt_logprobs(out, prompt, oracle.logprobs(prompt))
    assert out.outputs[0].token_ids == oracle.greedy(prompt, 12)


def test_prompt_logprobs_beside_a_constrained_request(llama_path, hf_oracle):
    prompt = [7, 8, 9, 10, 11, 12]
    llm = LLM(llama_path, async_scheduling=True)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": prompt}, {"prompt_token_ids": [3, 4, 5]}],
            [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0),
             SamplingParams(temperature=0.0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))])
    finally:
        llm.shutdown()
    oracle = hf_oracle(llama_path)
    _check_prompt_logprobs(outs[0], prompt, oracle.logprobs(prompt))
    assert outs[0].outputs[0].token_ids == oracle.greedy(prompt, 6)
    assert outs[1].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_and_speculation_beside_a_constrained_request(
        llama_path, hf_oracle, async_scheduling):
    """A step that defers its verification for a grammar keeps the prompt logprobs its
    forward computed, and the unconstrained request's drafts verify as alone."""
    prompt = [5, 9, 14, 5, 9, 14, 5, 9, 14, 22, 31]  # repeats: prompt lookup drafts
    llm = LLM(llama_path, async_scheduling=async_scheduling, speculative_config=NGRAM,
              max_num_batched_tokens=8)  # 8: the prompts are chunked
    try:
        outs = llm.generate(
            [{"prompt_token_ids": prompt}, {"prompt_token_ids": [3, 4, 5, 3, 4]}],
            [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1),
             SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="(ab){1,4}c"))])
    finally:
        llm.shutdown()
    oracle = hf_oracle(llama_path)
    _check_prompt_logprobs(outs[0], prompt, oracle.logprobs(prompt))
    assert outs[0].outputs[0].token_ids == oracle.greedy(prompt, 12)
    assert outs[1].outputs[0].finish_reason == "stop"
    assert re.fullmatch("(ab){1,4}c", outs[1].outputs[0].text), outs[1].outputs[0].text
