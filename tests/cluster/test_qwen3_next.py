"""Qwen3-Next: gated delta net layers (three in four) beside gated attention (each head's
output scaled by sigmoid of a gate its q_proj carries, q/k norms and every norm scaling by
1 + weight, a quarter of each head rotated), sparse experts with a gated shared expert,
and a dense layer. Greedy tokens equal transformers' Qwen3NextForCausalLM in sync and
async with chunked prefill and preemption, and under ngram speculation with drafts partly
accepted; fields raylm cannot honour refused by name. TP=2 x PP=2 on Ray:
tests/actors/test_pp_ray.py."""

from __future__ import annotations

import json
import shutil

import pytest
from engine_idle import idle_metrics
from family_check import assert_state_snapshot_hits

from raylm import LLM, SamplingParams
from raylm.runner.loading.checkpoint import (
    CheckpointSpec,
    scale_attention_output,
    write_random_checkpoint,
)

SPEC = CheckpointSpec(architecture="Qwen3NextForCausalLM", num_hidden_layers=4, head_dim=16,
                      num_experts=4, mlp_only_layers=(1,), seed=51)
# The third shares the first's first 20 tokens: a prefix hit from a state snapshot.
PROMPTS = [list(range(40, 72)), [5, 6], list(range(40, 60)) + list(range(100, 121)), [9],
           list(range(300, 320))]
LENGTHS = [16, 12, 9, 14, 10]


@pytest.fixture(scope="module")
def qwen3_next_path(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3_next") / "m"), SPEC)


def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_qwen3_next_equals_transformers(qwen3_next_path, async_scheduling, hf_oracle):
    oracle = hf_oracle(qwen3_next_path)
    with LLM(qwen3_next_path, block_size=4, num_kv_blocks=16, max_num_batched_tokens=8,
             max_num_seqs=4, async_scheduling=async_scheduling) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                             for n in LENGTHS])
        metrics = idle_metrics(llm)
    for p, n, out in zip(PROMPTS, LENGTHS, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, n), f"prompt of {len(p)} tokens"
    assert metrics["raylm:num_preemptions"] > 0
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0
    # The third prompt starts from the state saved where its hit on the first ends.
    assert metrics["raylm:prefix_cache_hits"] > 0


def test_the_rotary_fraction_is_honoured(qwen3_next_path, tmp_path, hf_oracle):
    """A config that rotates half of each head (not the default quarter) changes
    transformers' tokens, and raylm follows it."""
    reference = hf_oracle(qwen3_next_path).greedy(PROMPTS[0], 12)
    path = _with_config(qwen3_next_path, tmp_path / "half", rope_parameters={
        "rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    expected = hf_oracle(path).greedy(PROMPTS[0], 12)
    assert expected != reference
    with LLM(path, block_size=4) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected


def test_all_mode_saves_the_gated_delta_state_at_every_block_boundary(qwen3_next_path,
                                                                     hf_oracle):
    assert_state_snapshot_hits(qwen3_next_path, hf_oracle(qwen3_next_path), "all", 8)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculation_on_gated_delta_layers(tmp_path_factory, hf_oracle, async_scheduling):
    """Every mixer's output scaled down 100x: greedy text loops and ngram drafts are
    partly accepted; each next step continues from the state after its last accepted
    token."""
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("loopy_q3n") / "m"), SPEC)
    scale_attention_output(path, 0.01, ("o_proj.weight", "out_proj.weight"))
    prompts = [[412, 7, 99], list(range(40, 57)), list(range(300, 330))]
    with LLM(path, block_size=4, num_kv_blocks=24, max_num_batched_tokens=10, max_num_seqs=3,
             async_scheduling=async_scheduling,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        m = idle_metrics(llm)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_oracle(path).greedy(p, 40)
    accepted, drafted = (m["raylm:spec_decode_num_accepted_tokens"],
                         m["raylm:spec_decode_num_draft_tokens"])
    assert 0 < accepted < drafted, m
    assert m["raylm:kv_cache_usage_perc"] == 0.0
    assert m["raylm:prefix_cache_hits"] > 0  # speculation does not zero the state's hits


@pytest.mark.parametrize("field, value", [("linear_num_value_heads", 3),
                                          ("layer_types", ["linear_attention", "mamba",
                                                           "linear_attention",
                                                           "full_attention"]),
                                          ("hidden_act", "gelu")])
def test_a_field_raylm_cannot_honour_is_refused_by_name(qwen3_next_path, tmp_path, field,
                                                        value):
    path = _with_config(qwen3_next_path, tmp_path / "bad", **{field: value})
    with pytest.raises(ValueError, match=field):
        LLM(path)


def test_a_tp_size_that_splits_a_key_head_is_refused(qwen3_next_path):
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        LLM(qwen3_next_path, tensor_parallel_size=4)
