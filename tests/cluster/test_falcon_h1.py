"""Falcon-H1: a Mamba2 mixer and attention side by side in every layer, and its muP
multipliers everywhere (the embedding, keys, attention's input and output, the mixers'
input, each of z, x, B, C and dt, their output, the MLP's gate and output, the logits),
with the mixers' optional gated norm in its three forms. Greedy tokens equal
transformers' FalconH1ForCausalLM in sync and async with chunked prefill and forced
preemption; logprobs of the scaled logits; fields raylm cannot honour refused by name.
TP=2 x PP=2 on Ray: tests/actors/test_pp_ray.py."""

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
MULTIPLIERS = (("embedding_multiplier", 2.0), ("key_multiplier", 0.7),
               ("attention_in_multiplier", 1.3), ("attention_out_multiplier", 0.8),
               ("ssm_out_multiplier", 1.2), ("mlp_multipliers", [0.9, 1.1]),
               ("ssm_in_multiplier", 0.6), ("ssm_multipliers", [1.1, 0.9, 1.2, 0.8, 1.3]),
               ("lm_head_multiplier", 0.5))
NORMS = {"norm-then-gate": (("mamba_rms_norm", True),),
         "gate-then-norm": (("mamba_rms_norm", True), ("mamba_norm_before_gate", False)),
         "gate-only": ()}


@pytest.fixture(scope="module", params=list(NORMS))
def falcon_path(request, tmp_path_factory) -> str:
    spec = CheckpointSpec(architecture="FalconH1ForCausalLM", num_hidden_layers=3, seed=61,
                          config_overrides=MULTIPLIERS + NORMS[request.param])
    return write_random_checkpoint(str(tmp_path_factory.mktemp("falcon_h1") / "m"), spec)


def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_falcon_h1_equals_transformers(falcon_path, async_scheduling, hf_oracle):
    oracle = hf_oracle(falcon_path)
    with LLM(falcon_path, block_size=4, num_kv_blocks=16, max_num_batched_tokens=8,
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


@pytest.mark.parametrize("falcon_path", ["norm-then-gate"], indirect=True)
def test_the_multipliers_change_the_models_tokens(falcon_path, tmp_path, hf_oracle):
    """So the equality above checks each one (lm_head_multiplier keeps the argmax: the
    logprobs below check it)."""
    reference = hf_oracle(falcon_path).greedy(PROMPTS[0], 12)
    for i, (name, value) in enumerate(MULTIPLIERS[:-1]):
        plain = [1.0] * len(value) if isinstance(value, list) else 1.0
        path = _with_config(falcon_path, tmp_path / str(i), **{name: plain})
        assert hf_oracle(path).greedy(PROMPTS[0], 12) != reference, name


@pytest.mark.parametrize("falcon_path", ["gate-only"], indirect=True)
def test_logprobs_are_of_the_scaled_logits(falcon_path, hf_oracle):
    oracle = hf_oracle(falcon_path)
    with LLM(falcon_path, block_size=4) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                          logprobs=0))[0].outputs[0]
    tokens = list(out.token_ids)
    ref = oracle.logprobs(PROMPTS[0] + tokens)[len(PROMPTS[0]) - 1:-1]
    ours = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
    assert ours == pytest.approx([float(ref[i, t]) for i, t in enumerate(tokens)], abs=1e-4)
    unscaled = [float(v) for v in (ref * 2.0).log_softmax(-1)[range(len(tokens)), tokens]]
    assert ours != pytest.approx(unscaled, abs=1e-2)


@pytest.mark.parametrize("falcon_path", ["gate-only"], indirect=True)
@pytest.mark.parametrize("field, value", [("projectors_bias", True),
                                          ("mlp_multipliers", [1.0, 1.0, 1.0]),
                                          ("ssm_multipliers", [1.0, 1.0]),
                                          ("mamba_proj_bias", True)])
def test_a_field_raylm_cannot_honour_is_refused_by_name(falcon_path, tmp_path, field, value):
    path = _with_config(falcon_path, tmp_path / "bad", **{field: value})
    with pytest.raises(ValueError, match=field):
        LLM(path)
