"""EAGLE-1 and EAGLE-3 heads drafting under sync and async scheduling: transformers' greedy
tokens whatever the head proposes, and each proposal the head's own greedy chain after
the history it drafted from (a plain-torch reference over the whole history), through
chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import random

import pytest
from eagle_heads import (
    ReferenceHead,
    record_drafts,
    with_unit_final_norm,
    write_eagle_head,
    write_target_copy_head,
)
from host_reads import assert_only_the_copier_reads, steady_generate_reads
from test_spec_decode import _mixed_batch, _no_leak, _tokens

from raylm import LLM, SamplingParams

K = 3


@pytest.fixture(scope="module")
def heads(llama_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle_heads")
    return {m: write_eagle_head(str(root / m), llama_path, m, seed=i)
            for i, m in enumerate(("eagle", "eagle3"))}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 30, 17, 5, 26)]
    return prompts + [prompts[1][:20] + [rng.randrange(3, vocab) for _ in range(4)]]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_equals_hf_and_drafts_are_the_heads_chain(
        llama_path, heads, hf_oracle, monkeypatch, method, async_scheduling):
    seen = record_drafts(monkeypatch)
    # A 24-token budget chunks the long prompts; 40 blocks of 4 tokens cannot hold every
    # request at full length (preemption); the last prompt shares 20 tokens with the
    # second (prefix hits). A near-free verified position keeps the gate drafting though
    # a random head is rarely right.
    llm = LLM(llama_path, async_scheduling=async_scheduling, block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=24, max_num_seqs=6,
              speculative_config={"method": method, "model": heads[method],
                                  "num_speculative_tokens": K,
                                  "draft_step_overhead_tokens": 1e6})
    oracle = hf_oracle(llama_path)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)
    max_tokens = [20, 24, 16, 22, 18, 12]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                         for m in max_tokens])
    for p, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, m), f"prompt of {len(p)} diverged"
    m = _no_leak(llm)
    assert m["raylm:num_preemptions"] > 0 and m["raylm:prefix_cache_hits"] > 0, m
    assert m["raylm:spec_decode_num_draft_tokens"] > 0, m
    llm.shutdown()
    reference = ReferenceHead(heads[method], oracle.model, method)
    assert len(seen) >= 20, len(seen)
    for history, drafts in seen:
        assert drafts == reference.drafts(history, len(drafts)), (
            f"after {len(history)} tokens the head proposed {drafts}")


def test_bad_heads_are_refused_by_name(llama_path, heads, tmp_path):
    with pytest.raises(ValueError, match="not an EAGLE-1 head"):
        LLM(llama_path, speculative_config={"method": "eagle", "model": heads["eagle3"],
                                            "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def agreeing(loopy_llama_path, tmp_path_factory) -> tuple[str, str]:
    """(target, head): the loopy checkpoint with a unit final norm, and an EAGLE-1 head of
    its own layers that predicts its next token most of the time."""
    root = tmp_path_factory.mktemp("eagle_agreeing")
    target = with_unit_final_norm(loopy_llama_path, str(root / "target"))
    return target, write_target_copy_head(str(root / "head"), target)


def test_a_head_that_predicts_the_target_is_accepted_with_no_host_reads(agreeing, hf_oracle):
    """Async steady steps with a head that mostly agrees with the target: drafts accepted,
    tokens exact, and no read of a device tensor outside the copier (the head's pass and
    chain stay on the device)."""
    target, head = agreeing
    llm = LLM(target, async_scheduling=True, block_size=4, num_kv_blocks=96,
              speculative_config={"method": "eagle", "model": head,
                                  "num_speculative_tokens": K})
    try:
        prompts = _prompts(llm.llm_engine.model_config.vocab_size)[:3]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        batch = [{"prompt_token_ids": p} for p in prompts]
        outs, reads = steady_generate_reads(llm, batch, params)
        m = llm.get_metrics()
    finally:
        llm.shutdown()
    oracle = hf_oracle(target)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 24)
    drafted, accepted = (m["raylm:spec_decode_num_draft_tokens"],
                         m["raylm:spec_decode_num_accepted_tokens"])
    assert accepted > 0.5 * drafted > 0, m  # the head is right more often than not
    assert_only_the_copier_reads(reads)


def test_seeded_sampling_penalties_logprobs_and_n_unchanged_by_eagle(agreeing):
    """Seeded sampling, penalties, logprobs and n > 1 give the tokens and logprobs of no
    speculation, sync and async: drafts are verified against the target's own draws."""
    target, head = agreeing
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": K}
    results = {}
    for speculative_config in (None, spec):
        for async_scheduling in (False, True):
            llm = LLM(target, async_scheduling=async_scheduling,
                      speculative_config=speculative_config)
            prompts, params = _mixed_batch(llm.llm_engine.model_config.vocab_size)
            results[speculative_config is not None, async_scheduling] = llm.generate(
                prompts, params)
            if speculative_config is not None:
                assert _no_leak(llm)["raylm:spec_decode_num_accepted_tokens"] > 0
            llm.shutdown()
    ref = results[False, False]
    for key, outs in results.items():
        assert _tokens(outs) == _tokens(ref), key
        for o, r in zip(outs, ref, strict=True):
            for c, rc in zip(o.outputs, r.outputs, strict=True):
                for entry, ref_entry in zip(c.logprobs or [], rc.logprobs or [], strict=True):
                    assert entry.keys() == ref_entry.keys()
                    for t in entry:
                        assert entry[t].logprob == pytest.approx(ref_entry[t].logprob, abs=1e-4)
