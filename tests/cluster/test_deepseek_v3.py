"""DeepSeek-V3: multi-head latent attention over a cache that holds only the latent and the
rotated key, and the grouped sigmoid router. The router against transformers' own module;
the whole model against transformers token for token (sync and async, chunked prefill,
prefix hits, preemption, ngram speculation, the KV offload tier, a plain q_proj with YaRN);
the cache's size per token from the engine's accounting; unsupported fields refused."""

from __future__ import annotations

import json
import random

import pytest
import torch
from family_check import assert_greedy_equals_transformers, with_config

from raylm import LLM, SamplingParams
from raylm.cluster.engine.engine_args import kv_bytes_per_block
from raylm.parallel.context import ParallelContext
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.runner.models.moe import SparseMoeBlock
from raylm.scheduler.config.mla_shape import MLAShape
from raylm.scheduler.config.moe_layout import GroupedSigmoidRouting

# Latent of 32 + rotated key of 16 per token; 4 heads of 16 + 16 query/key channels and
# 24 value channels; layer 0 dense, the others 8 experts in 2 groups, top 2 from 1 group.
SPEC = CheckpointSpec(architecture="DeepseekV3ForCausalLM", num_hidden_layers=3, seed=41)
# No query low-rank pair, YaRN RoPE whose mscale_all_dim scales the softmax.
PLAIN_Q = CheckpointSpec(
    architecture="DeepseekV3ForCausalLM", num_hidden_layers=2, q_lora_rank=None, seed=43,
    n_group=4, topk_group=2, config_overrides=(("rope_parameters", {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1}),))


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return {name: write_random_checkpoint(str(tmp_path_factory.mktemp(name)), spec)
            for name, spec in (("mla", SPEC), ("plain-q", PLAIN_Q))}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    return [shared + [7, 8], shared + [rng.randrange(3, 512) for _ in range(25)],
            [rng.randrange(3, 512) for _ in range(33)], [5, 6]]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_deepseek_v3_equals_transformers(paths, async_scheduling, hf_oracle):
    assert_greedy_equals_transformers(
        paths["mla"], hf_oracle(paths["mla"]), _prompts(), [14, 9, 16, 20],
        async_scheduling=async_scheduling, block_size=4, num_kv_blocks=28,
        max_num_batched_tokens=16, max_num_seqs=4)


def test_plain_query_and_yarn_equal_transformers(paths, hf_oracle):
    path = paths["plain-q"]
    with open(f"{path}/config.json") as f:
        hf = json.load(f)
    from transformers.modeling_rope_utils import yarn_apply_mscale

    shape = MLAShape.from_hf(hf)
    assert shape.q_lora_rank is None
    assert shape.scale == pytest.approx(yarn_apply_mscale(hf["rope_parameters"], 32 ** -0.5))
    assert shape.scale != pytest.approx(32 ** -0.5)  # the mscale matters here
    prompts = _prompts()
    with LLM(path, block_size=4, async_scheduling=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_oracle(path).greedy(p, 10)


def test_the_cache_holds_the_latent_and_rotated_key_alone(paths):
    """Per token and layer: kv_lora_rank + qk_rope_head_dim elements (32 + 16), one tensor
    per layer, against 2 x 4 heads x 32 for the keys and values it expands to."""
    with LLM(paths["mla"], block_size=4, num_kv_blocks=16, dtype="float32") as llm:
        runner = llm.llm_engine.core.engine_core.executor.worker.model_runner
        per_block = runner.kv_cache_bytes_per_block()
        key, value = runner.kv_caches[0]
    assert per_block == 3 * 4 * (32 + 16) * 4
    assert key is value and tuple(key.shape[1:]) == (1, 4, 48)
    with open(f"{paths['mla']}/config.json") as f:
        assert kv_bytes_per_block(json.load(f), "float32", 4) == per_block


def test_ngram_speculation_and_the_offload_tier_equal_transformers(paths, hf_oracle):
    path, oracle = paths["mla"], hf_oracle(paths["mla"])
    phrase = [11, 12, 13, 14, 15, 16]
    prompts = [phrase * 4, [40, 41] + phrase * 3]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(path, async_scheduling=True, speculative_config=spec, block_size=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.get_metrics()["raylm:spec_decode_num_draft_tokens"] > 0
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 12)
    # A pool of 8 blocks of 4 holds one 24-token prompt: each evicts the one before, and
    # the repeats load their prefix from the host tier.
    long = [[random.Random(i).randrange(3, 512) for _ in range(24)] for i in range(2)]
    with LLM(path, block_size=4, num_kv_blocks=10, max_num_seqs=1,
             kv_offloading_size=64 * 4 * 48 * 4 * 3 / 2**30) as llm:
        for p in (long[0], long[1], long[0], long[1]):
            out = llm.generate([{"prompt_token_ids": p}], SamplingParams(
                temperature=0.0, max_tokens=4, ignore_eos=True))
            assert out[0].outputs[0].token_ids == oracle.greedy(p, 4)
        metrics = llm.get_metrics()
    assert metrics["raylm:external_prefix_cache_hits"] > 0
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0


def test_grouped_sigmoid_router_equals_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=16, n_routed_experts=12, num_experts_per_tok=3,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(config)
    torch.manual_seed(3)
    hf.weight.data.normal_()
    hf.e_score_correction_bias.normal_()
    block = SparseMoeBlock(16, 8, 12, 3, True, ParallelContext.single(), torch.float32, 0,
                           grouped_sigmoid=GroupedSigmoidRouting(4, 2, 2.5))
    block.gate.weight.data.copy_(hf.weight.data)
    assert block.gate.e_score_correction_bias is not None
    block.gate.e_score_correction_bias.data.copy_(hf.e_score_correction_bias)
    x = torch.randn(40, 16)
    _, want_weights, want_experts = hf(x)
    weights, experts = block.route(x)
    order, want_order = experts.sort(dim=-1), want_experts.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices),
                               want_weights.gather(1, want_order.indices))
    # Only experts of the chosen groups (3 per group): at most topk_group groups per token.
    assert max(len(set((experts[t] // 3).tolist())) for t in range(40)) <= 2


@pytest.mark.parametrize(("fields", "message"), [
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported for DeepSeek-V3"),
    ({"topk_method": "greedy"}, "topk_method='greedy' is not supported for DeepSeek-V3"),
    ({"n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
    ({"topk_group": 3}, r"topk_group must be in \[1, n_group=2\], got 3"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even, got 15"),
])
def test_a_deepseek_field_raylm_cannot_honour_is_refused_by_name(paths, fields, message,
                                                                 tmp_path):
    path = with_config(paths["mla"], tmp_path / "refused", **fields)
    with pytest.raises(ValueError, match=message):
        LLM(path)
