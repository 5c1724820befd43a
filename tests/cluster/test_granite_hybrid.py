"""Granite 4 (GraniteMoeHybrid): Mamba2 and attention layers, with experts and an ungated
shared MLP, or the shared MLP alone; its embedding, residual, attention and logit
multipliers; RoPE or no position embedding. Greedy tokens equal transformers' in sync and
async, with chunked prefill and forced preemption; fields raylm cannot honour refused by
name. TP=2 x PP=2 with expert parallelism on Ray: tests/actors/test_pp_ray.py."""

from __future__ import annotations

import json
import shutil

import pytest
from engine_idle import idle_metrics

from raylm import LLM, SamplingParams
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

# The third shares the first's first 20 tokens: a prefix hit from a state snapshot.
PROMPTS = [list(range(40, 72)), [5, 6], list(range(40, 60)) + list(range(100, 121)), [9],
           list(range(300, 320))]
LENGTHS = [16, 12, 9, 14, 10]
MULTIPLIERS = (("embedding_multiplier", 3.0), ("residual_multiplier", 0.5),
               ("attention_multiplier", 0.3), ("logits_scaling", 2.0))
VARIANTS = {
    # Experts (4, top 2) beside the shared MLP in every layer; RoPE in the attention layer.
    "moe-rope": CheckpointSpec(architecture="GraniteMoeHybridForCausalLM", num_hidden_layers=3,
                               layer_types=("mamba", "attention", "mamba"), num_experts=4,
                               seed=45, config_overrides=MULTIPLIERS
                               + (("position_embedding_type", "rope"),)),
    # The shared MLP alone; attention first and without any position embedding.
    "dense-nope": CheckpointSpec(architecture="GraniteMoeHybridForCausalLM",
                                 num_hidden_layers=3, layer_types=("attention", "mamba", "mamba"),
                                 num_experts=0, seed=46, config_overrides=MULTIPLIERS),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def granite_path(request, tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("granite") / "m"),
                                   VARIANTS[request.param])


def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_granite_hybrid_equals_transformers(granite_path, async_scheduling, hf_oracle):
    oracle = hf_oracle(granite_path)
    with LLM(granite_path, block_size=4, num_kv_blocks=16, max_num_batched_tokens=8,
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


def test_the_multipliers_change_the_models_tokens(granite_path, tmp_path, hf_oracle):
    """So the equality above checks each of them (logits_scaling, which keeps the argmax,
    is checked on the logprobs below)."""
    reference = hf_oracle(granite_path).greedy(PROMPTS[0], 12)
    for i, (name, _) in enumerate(MULTIPLIERS[:3]):
        plain = _with_config(granite_path, tmp_path / str(i), **{name: 1.0})
        assert hf_oracle(plain).greedy(PROMPTS[0], 12) != reference, name


def test_logprobs_are_of_the_scaled_logits(granite_path, hf_oracle):
    """The sampled tokens' logprobs equal transformers' log-softmax of its logits divided
    by logits_scaling=2, which differ from those of the unscaled logits."""
    oracle = hf_oracle(granite_path)
    with LLM(granite_path, block_size=4) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                          logprobs=0))[0].outputs[0]
    tokens = list(out.token_ids)
    ref = oracle.logprobs(PROMPTS[0] + tokens)[len(PROMPTS[0]) - 1:-1]
    ours = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
    want = [float(ref[i, t]) for i, t in enumerate(tokens)]
    assert ours == pytest.approx(want, abs=1e-4)
    unscaled = [float(v) for v in (ref * 2.0).log_softmax(-1)[range(len(tokens)), tokens]]
    assert ours != pytest.approx(unscaled, abs=1e-2)


@pytest.mark.parametrize("field, value", [("position_embedding_type", "alibi"),
                                          ("layer_types", ["mamba", "cross", "mamba"]),
                                          ("residual_multiplier", -1.0),
                                          ("mamba_proj_bias", True)])
def test_a_field_raylm_cannot_honour_is_refused_by_name(granite_path, tmp_path, field, value):
    path = _with_config(granite_path, tmp_path / "bad", **{field: value})
    with pytest.raises(ValueError, match=field):
        LLM(path)


def test_lora_is_refused_by_name(granite_path):
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(granite_path, enable_lora=True)
