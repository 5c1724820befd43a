"""Embeddings on Ray: with PP=2 only the last stage pools (its final-norm hidden states);
with TP=2 every rank computes the same vector and the driver's comes back. Mixed with
greedy generations, chunked prefill and preemption; equal to transformers in fp32."""

from __future__ import annotations

import random

import pytest
import torch
from engine_idle import idle_metrics

from raylm import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    yield ray_local


@pytest.mark.parametrize(("tp", "pp", "async_scheduling"), [
    pytest.param(2, 1, False, id="tp2-sync"),
    pytest.param(1, 2, True, id="pp2-async"),
])
def test_embeddings_on_ray_equal_transformers(llama_path, hf_oracle, tp, pp, async_scheduling):
    oracle = hf_oracle(llama_path)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (8, 29, 8, 13)]
    kinds = [16, ("mean", True), 16, ("last", True)]
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
              if isinstance(k, int) else
              SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams(*k))
              for k in kinds]
    llm = LLM(llama_path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              async_scheduling=async_scheduling, block_size=4, num_kv_blocks=14,
              max_num_batched_tokens=8, max_num_seqs=4)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, prompt, kind in zip(outs, prompts, kinds, strict=True):
            if isinstance(kind, int):
                assert list(out.outputs[0].token_ids) == oracle.greedy(prompt, kind)
                continue
            hidden = oracle.last_hidden_states(prompt)
            want = torch.nn.functional.normalize(
                hidden[-1] if kind[0] == "last" else hidden.mean(dim=0), dim=0)
            assert torch.allclose(torch.tensor(out.pooled), want, atol=1e-5, rtol=0), kind
        metrics = idle_metrics(llm)
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()
