"""The KV offload tier on the real model: a device pool small enough to evict, prompts that
come back; tokens equal transformers with the tier on and off, and with a fault injector
that spoils loads (they are recomputed: the same tokens, no leak, the loss counted).
"""

from __future__ import annotations

import random

import pytest

from raylm import LLM, SamplingParams

ASYNC_MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
BLOCK = 16


def _prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _run(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def _engine(path: str, async_scheduling: bool, **kv) -> LLM:
    # 12 blocks of 16 tokens: one 96-token prompt and its outputs fit; the next evicts it.
    return LLM(path, block_size=BLOCK, num_kv_blocks=12, max_num_seqs=2,
               max_num_batched_tokens=64, async_scheduling=async_scheduling, **kv)


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_offload_tier_loads_evicted_prefixes(llama_path, hf_oracle, async_scheduling):
    """Offload on and off give transformers' tokens; on, the repeats load their prefix
    from the host tier instead of computing it."""
    prompts = _prompts(512, 3, 96)
    order = [0, 1, 2, 0, 1, 2]  # each prompt is evicted before it comes back
    oracle = hf_oracle(llama_path)
    want = {i: oracle.greedy(prompts[i], 4) for i in range(3)}
    off = _engine(llama_path, async_scheduling)
    llm = _engine(llama_path, async_scheduling, kv_offloading_size=64 * 16 * 2048 / 2**30)
    for i in order:  # one at a time: the pool holds one prompt
        assert _run(off, [prompts[i]], 4) == [want[i]]
        assert _run(llm, [prompts[i]], 4) == [want[i]]
    assert off.get_metrics()["raylm:prefix_cache_hits"] == 0  # all recomputed
    off.shutdown()
    m = llm.get_metrics()
    # Five of six prompt blocks come back from the host on each repeat (the last is
    # partial or must be computed), none from the device pool.
    assert m["raylm:external_prefix_cache_hits"] == 3 * 5 * BLOCK
    assert m['raylm:kv_offload_total_bytes{transfer_type="CPU_to_GPU"}'] > 0
    assert m["raylm:kv_offload_cpu_block_hit"] == 15
    assert m["raylm:kv_cache_usage_perc"] == 0.0
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_failed_offload_loads_are_recomputed(llama_path, hf_oracle, async_scheduling):
    """Every load from the host fails (its blocks are garbage): each repeat recomputes its
    whole prompt, with the tokens transformers gives; the recomputed-token metric counts
    the 5 loaded blocks plus the tokens computed on them."""
    prompts = _prompts(512, 3, 96, seed=1)
    oracle = hf_oracle(llama_path)
    want = [oracle.greedy(p, 4) for p in prompts]
    llm = _engine(llama_path, async_scheduling, kv_transfer_config={
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"num_cpu_blocks": 64,
                                      "fault_injection": {"fail_all": True}}})
    for i in (0, 1, 2, 0, 1, 2):
        assert _run(llm, [prompts[i]], 4) == [want[i]]
    m = llm.get_metrics()
    assert m["raylm:kv_connector_num_failed_loads"] == 3 * 5
    # Each failed repeat loaded 80 tokens and computed 16 more on them (one step).
    assert m["raylm:kv_connector_num_recomputed_tokens"] == 3 * 96
    assert m["raylm:kv_cache_usage_perc"] == 0.0
    llm.shutdown()
