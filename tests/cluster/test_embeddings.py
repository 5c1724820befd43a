"""Embeddings through the engine (SamplingParams.pooling, LLM.embed) against transformers'
final-norm hidden states in fp32: last-token and mean pooling, normalized or not, mixed in
one batch with greedy generations (whose tokens stay transformers' own), sync and async,
through chunked prefill (mean pooling sums chunk by chunk), preemption (a recomputed
prompt is not pooled twice) and prefix caching (mean pooling takes no cached block)."""

from __future__ import annotations

import random

import pytest
import torch
from test_llm_correctness import ASYNC_MODES

from raylm import LLM, PoolingParams, SamplingParams

ENGINE = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=6,
              enable_prefix_caching=True)
LENGTHS = [3, 37, 9, 30, 14, 22, 6, 41]
# Per request: a pooling type (embedding) or None (a greedy generation of that many tokens).
KINDS = [("last", True), 20, ("mean", True), 24, ("mean", False), 18, ("last", False), 16]


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


def _reference(oracle, prompt: list[int], kind) -> list[float] | list[int]:
    if isinstance(kind, int):
        return oracle.greedy(prompt, kind)
    pooling, normalize = kind
    hidden = oracle.last_hidden_states(prompt)
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).tolist()


def idle_metrics(llm: LLM) -> dict:
    """Metrics once the steps still in flight for finished requests have returned."""
    for _ in range(50):
        metrics = llm.get_metrics()
        if metrics["raylm:num_requests_running"] == 0 and \
                metrics["raylm:kv_cache_usage_perc"] == 0.0:
            break
        llm.llm_engine.step(timeout=0.1)
    return metrics


def _params(kind) -> SamplingParams:
    if isinstance(kind, int):
        return SamplingParams(temperature=0.0, max_tokens=kind, ignore_eos=True)
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          pooling=PoolingParams(*kind))


def _close(got: list[float], want: list[float]) -> bool:
    return torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_embeddings_beside_generations_equal_transformers(llama_path, hf_oracle,
                                                          async_scheduling):
    oracle = hf_oracle(llama_path)
    prompts = _prompts()
    llm = LLM(llama_path, async_scheduling=async_scheduling, **ENGINE)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [_params(k) for k in KINDS], use_tqdm=False)
        for out, prompt, kind in zip(outs, prompts, KINDS, strict=True):
            want = _reference(oracle, prompt, kind)
            if isinstance(kind, int):
                assert list(out.outputs[0].token_ids) == want and out.pooled is None
            else:
                assert out.pooled is not None and _close(out.pooled, want), kind
        metrics = idle_metrics(llm)
        assert metrics["raylm:num_preemptions"] > 0, metrics  # the pool is small on purpose
        # Again, every prompt's blocks cached now: mean pooling must compute every row.
        again = llm.embed([{"prompt_token_ids": p} for p in prompts], pooling_type="mean",
                          use_tqdm=False)
        for out, prompt in zip(again, prompts, strict=True):
            assert out.prompt_token_ids == prompt
            assert _close(out.outputs.embedding, _reference(oracle, prompt, ("mean", True)))
        last = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for out, prompt in zip(last, prompts, strict=True):
            assert _close(out.outputs.embedding, _reference(oracle, prompt, ("last", True)))
        assert idle_metrics(llm)["raylm:prefix_cache_hits"] > 0  # "last" may hit the cache
    finally:
        llm.shutdown()


def test_embedding_params_refuse_what_pooling_cannot_do():
    for bad in (dict(n=2), dict(max_tokens=4), dict(logprobs=1), dict(prompt_logprobs=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**{"max_tokens": 1, **bad}, pooling=PoolingParams())
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams("cls")


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_a_preempted_or_cached_mean_prompt_pools_each_row_once(llama_path, hf_oracle,
                                                               async_scheduling):
    """Two generations grow while a long mean-pooled prompt prefills in chunks: it is the
    newest running request, so the one preempted, and recomputed from position 0. Then the
    same prompt twice, its blocks cached by the first."""
    oracle = hf_oracle(llama_path)
    rng = random.Random(9)
    gens = [[rng.randrange(3, 512) for _ in range(8)] for _ in range(2)]
    long = [rng.randrange(3, 512) for _ in range(30)]
    llm = LLM(llama_path, async_scheduling=async_scheduling, block_size=4, num_kv_blocks=12,
              max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=True)
    try:
        before = llm.get_metrics()["raylm:num_preemptions"]
        outs = llm.generate([{"prompt_token_ids": p} for p in (*gens, long)],
                            [_params(40), _params(40), _params(("mean", True))],
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs[:2]] == \
            [oracle.greedy(p, 40) for p in gens]
        want = _reference(oracle, long, ("mean", True))
        assert _close(outs[2].pooled, want)
        assert idle_metrics(llm)["raylm:num_preemptions"] > before
        for _ in range(2):
            (out,) = llm.embed([{"prompt_token_ids": long}], pooling_type="mean", use_tqdm=False)
            assert _close(out.outputs.embedding, want)
    finally:
        llm.shutdown()
