"""Multi-LoRA on Ray: TP=2 (each rank holds its shard of every adapter: B's rows of q/k/v
and gate/up, A's columns of o and down) and PP=2 (each stage its layers' parts), sync
and async, greedy tokens equal to transformers + PEFT for four adapters of different
ranks and the base model in one mixed batch, under forced preemption (20 KV blocks of 4
tokens) and chunked prefill (a 16-token budget)."""

from __future__ import annotations

import random

import pytest
from engine_idle import idle_metrics

from raylm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.ray

ENGINE = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=6,
              enable_lora=True, max_loras=4, max_lora_rank=16)
ADAPTER_OF = [0, None, 1, 2, 3, 1]
PROMPT_LENGTHS = [3, 21, 9, 30, 14, 6]
MAX_TOKENS = [18, 12, 24, 10, 20, 16]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    yield ray_local


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(lora_adapters, peft_oracle) -> list[list[int]]:
    return [peft_oracle.greedy(None if a is None else lora_adapters[a], p, m)
            for a, p, m in zip(ADAPTER_OF, _prompts(), MAX_TOKENS, strict=True)]


@pytest.mark.parametrize(("tp", "pp", "async_scheduling"), [
    pytest.param(2, 1, False, id="tp2-sync"),
    pytest.param(2, 1, True, id="tp2-async"),
    pytest.param(1, 2, False, id="pp2-sync"),
    pytest.param(1, 2, True, id="pp2-async"),
])
def test_lora_on_ray_equals_peft(llama_path, lora_adapters, expected, tp, pp,
                                 async_scheduling):
    llm = LLM(llama_path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              async_scheduling=async_scheduling, **ENGINE)
    try:
        loras = [None if a is None else LoRARequest(f"adapter{a}", a + 1, lora_adapters[a])
                 for a in ADAPTER_OF]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in MAX_TOKENS]
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                            lora_request=loras, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        metrics = idle_metrics(llm)
        assert metrics["raylm:num_preemptions"] > 0, metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()
