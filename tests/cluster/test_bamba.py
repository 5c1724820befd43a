"""Bamba, a Mamba2 + attention hybrid: greedy tokens equal transformers' BambaForCausalLM in
sync and async, with prefills chunked into spans that carry the state across steps,
forced preemption (a preempted request's state restarts from zeros as it recomputes), and
the partial rotary embedding of its attention layer; with speculative decoding (ngram, a
draft model) drafts partly accepted; prefix hits that start from a snapshot of the state
at a block boundary (scheduler/kv/state_snapshots.py), and what its per-request state
rules out is refused by name.
TP=2 x PP=2 on Ray: tests/actors/test_pp_ray.py."""

from __future__ import annotations

import json
import shutil

import pytest
from engine_idle import idle_metrics
from family_check import assert_state_snapshot_hits

from raylm import LLM, SamplingParams
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

SHARED = list(range(100, 120))
PROMPTS = [SHARED + [7, 8, 9], SHARED + list(range(200, 230)), list(range(40, 72)), [5],
           list(range(300, 341))]
LENGTHS = [14, 9, 16, 20, 11]


@pytest.fixture(scope="module")
def bamba_path(tmp_path_factory) -> str:
    """4 layers: Mamba2 at 0, 2 and 3 (8 heads in 2 groups, chunks of 8), attention at 1."""
    spec = CheckpointSpec(architecture="BambaForCausalLM", num_hidden_layers=4,
                          attn_layer_indices=(1,), seed=41)
    return write_random_checkpoint(str(tmp_path_factory.mktemp("bamba") / "m"), spec)


def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bamba_equals_transformers(bamba_path, async_scheduling, hf_oracle):
    """A 8-token budget chunks every long prompt into spans cut at block boundaries (the
    41-token one into six), 18 blocks of 4 tokens for five requests force preemptions, and
    prefix hits start from the states saved at those boundaries."""
    oracle = hf_oracle(bamba_path)
    with LLM(bamba_path, block_size=4, num_kv_blocks=18, max_num_batched_tokens=8,
             max_num_seqs=4, async_scheduling=async_scheduling) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                             for n in LENGTHS])
        metrics = idle_metrics(llm)
        caching = llm.llm_engine.engine_config.cache_config.enable_prefix_caching
    for p, n, out in zip(PROMPTS, LENGTHS, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, n), f"prompt of {len(p)} tokens"
    assert metrics["raylm:num_preemptions"] > 0
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0
    # Two prompts share a 20-token start, and a preempted request recomputes its own
    # prefix: hits start from the state snapshot where they end.
    assert caching and metrics["raylm:prefix_cache_hits"] > 0


def test_the_state_layers_and_the_partial_rotary_change_the_models_tokens(
        bamba_path, tmp_path, hf_oracle):
    """Both are in the oracle's tokens, so the equality above checks them."""
    reference = hf_oracle(bamba_path).greedy(PROMPTS[2], 12)
    attention_only = _with_config(bamba_path, tmp_path / "attn", attn_layer_indices=[1],
                                  num_hidden_layers=2)
    assert hf_oracle(attention_only).greedy(PROMPTS[2], 12) != reference
    # rope_parameters may rotate whole heads; a config of before transformers 5 (rope_theta
    # alone) rotates half, as transformers reads it.
    full_rotary = _with_config(bamba_path, tmp_path / "rope", rope_parameters={
        "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "rope_type": "default"})
    old_style = _with_config(bamba_path, tmp_path / "old", rope_parameters=None,
                             rope_theta=10000.0)
    expected = hf_oracle(full_rotary).greedy(PROMPTS[2], 12)
    assert expected != reference and hf_oracle(old_style).greedy(PROMPTS[2], 12) == reference
    for path, want in ((full_rotary, expected), (old_style, reference)):
        with LLM(path, block_size=4) as llm:
            out = llm.generate([{"prompt_token_ids": PROMPTS[2]}],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        assert out[0].outputs[0].token_ids == want


LOOP_PROMPTS = [[412, 7, 99], list(range(40, 57)), list(range(300, 330)), [5, 9, 13, 21]]


@pytest.mark.parametrize("mode, hits", [("align", 0), ("all", 8)])
def test_all_mode_saves_the_state_at_every_block_boundary_a_prefill_passes(
        bamba_path, hf_oracle, mode, hits):
    assert_state_snapshot_hits(bamba_path, hf_oracle(bamba_path), mode, hits)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculation_on_a_hybrid_equals_transformers(loopy_bamba_path, bamba_mlp_draft_path,
                                                     hf_oracle, method, async_scheduling):
    """The seed's case: drafts verified on a Mamba2 hybrid, some accepted and some not, so
    each next step continues from the state after its last accepted token (a slot of its
    own). A 10-token budget chunks the prompts and 24 blocks force preemptions."""
    spec = ({"method": "ngram", "num_speculative_tokens": 3} if method == "ngram" else
            {"method": "draft_model", "model": bamba_mlp_draft_path,
             "num_speculative_tokens": 3})
    oracle = hf_oracle(loopy_bamba_path)
    with LLM(loopy_bamba_path, block_size=4, num_kv_blocks=24, max_num_batched_tokens=10,
             max_num_seqs=4, async_scheduling=async_scheduling,
             speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in LOOP_PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        m = idle_metrics(llm)  # steps booked for finished requests may still be in flight
    for p, out in zip(LOOP_PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 40), f"prompt of {len(p)} tokens"
    accepted, drafted = (m["raylm:spec_decode_num_accepted_tokens"],
                         m["raylm:spec_decode_num_draft_tokens"])
    assert 0 < accepted < drafted, m  # partial acceptance: every slot index is exercised
    assert m["raylm:num_preemptions"] > 0 and m["raylm:kv_cache_usage_perc"] == 0.0
    assert m["raylm:prefix_cache_hits"] > 0  # speculation does not zero the state's hits


def test_a_hybrid_draft_model_is_refused(loopy_bamba_path):
    with pytest.raises(ValueError, match="a draft model must be attention-only"):
        LLM(loopy_bamba_path, speculative_config={"method": "draft_model",
                                                  "model": loopy_bamba_path,
                                                  "num_speculative_tokens": 2})


@pytest.mark.parametrize("engine, name", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
      "pipeline_parallel_size": 2}, "speculative_config with pipeline_parallel_size"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blocks": 8}}},
     "kv_transfer_config"),
    ({"enable_lora": True}, "enable_lora"),
    ({"tensor_parallel_size": 4}, "mamba_n_groups"),  # 2 groups cannot split over 4 ranks
])
def test_what_the_state_rules_out_is_refused_by_name(bamba_path, engine, name):
    with pytest.raises(ValueError, match=name):
        LLM(bamba_path, **engine)


@pytest.mark.parametrize("field, value", [("mamba_proj_bias", True),
                                          ("hidden_act", "gelu"),
                                          ("attn_layer_indices", [1, 9]),
                                          ("mamba_n_groups", 3)])
def test_a_field_raylm_cannot_honour_is_refused_by_name(bamba_path, tmp_path, field, value):
    path = _with_config(bamba_path, tmp_path / "bad", **{field: value})
    with pytest.raises(ValueError, match=field):
        LLM(path)
