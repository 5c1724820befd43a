"""EAGLE-1 and EAGLE-3 heads drafting under sync and async scheduling: transformers' greedy
tokens whatever the head proposes, and each proposal the head's own greedy chain after
the history it drafted from (a plain-torch reference over the whole history), through
chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import random
import time

import pytest

from raylm import LLM, SamplingParams
from raylm.runner.spec_decode import eagle_proposer
from tests.eagle_heads import ReferenceHead, write_eagle_head

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


def _record_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Every proposal the head makes: (the history it followed, its drafts)."""
    seen: list[tuple[list[int], list[int]]] = []
    step = eagle_proposer.EagleProposer.step

    def recording(self, batch, hidden, sampling, wanted):
        drafts = step(self, batch, hidden, sampling, wanted)
        host = drafts.cpu().tolist()
        for i, r in enumerate(wanted):
            seen.append((self.input_batch.token_ids[r.row, :r.num_tokens].tolist(),
                         host[i][:r.max_drafts]))
        return drafts

    monkeypatch.setattr(eagle_proposer.EagleProposer, "step", recording)
    return seen


def _no_leak(llm: LLM) -> dict:
    deadline = time.monotonic() + 30.0
    m = llm.get_metrics()
    while m["raylm:kv_cache_usage_perc"] > 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
        m = llm.get_metrics()
    assert m["raylm:num_requests_running"] == 0 and m["raylm:kv_cache_usage_perc"] == 0.0, m
    return m


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_equals_hf_and_drafts_are_the_heads_chain(
        llama_path, heads, hf_oracle, monkeypatch, method, async_scheduling):
    seen = _record_drafts(monkeypatch)
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
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        LLM(llama_path, pipeline_parallel_size=2,
            speculative_config={"method": "eagle", "model": heads["eagle"],
                                "num_speculative_tokens": 2})
