"""Gemma 3 (text): norms scaling by 1 + weight, sandwich norms, the scaled embedding,
GELU (tanh), q/k norms, query_pre_attn_scalar, a sliding window on all layers but each
third with its own RoPE base, and final logit soft-capping, against transformers'
Gemma3ForCausalLM under the engine's hardest bookkeeping; a config field raylm cannot
honour is refused by name (attention soft-capping among them: transformers applies it to
Gemma 3 in eager attention only, not in its default sdpa; Gemma 2's is honoured,
tests/cluster/test_gemma2.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from family_check import assert_greedy_equals_transformers

from raylm import LLM, SamplingParams
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

PROMPT = list(range(40, 72))  # 32 tokens: far beyond the 5-token window


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory) -> str:
    spec = CheckpointSpec(architecture="Gemma3ForCausalLM", num_hidden_layers=3,
                          sliding_window=5, sliding_window_pattern=3, head_dim=16,
                          final_logit_softcapping=30.0, seed=31)
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gemma3") / "m"), spec)


def _with_config(src: str, dst, drop=(), **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_the_window_and_the_local_rope_change_the_models_tokens(gemma3_path, tmp_path,
                                                                hf_oracle):
    """Without its window, or with the global RoPE base on every layer, the same weights
    give other tokens: the equality below can fail on either."""
    config = json.loads(open(f"{gemma3_path}/config.json").read())
    reference = hf_oracle(gemma3_path).greedy(PROMPT, 12)
    full = _with_config(gemma3_path, tmp_path / "full", layer_types=["full_attention"] * 3)
    global_rope = dict(config["rope_parameters"],
                       sliding_attention=config["rope_parameters"]["full_attention"])
    one_base = _with_config(gemma3_path, tmp_path / "one_base", rope_parameters=global_rope)
    assert hf_oracle(full).greedy(PROMPT, 12) != reference
    assert hf_oracle(one_base).greedy(PROMPT, 12) != reference


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_gemma3_equals_transformers(gemma3_path, async_scheduling, hf_oracle):
    """Chunked prefill (a 16-token budget), prefix hits (a shared 20-token start) and
    preemption (45 blocks of 4 tokens; the layers are three KV cache groups of one layer
    each, so a block is one layer's page)."""
    shared = list(range(100, 120))
    prompts = [shared + [7, 8, 9], shared + list(range(200, 230)), PROMPT, [5, 6],
               list(range(300, 341))]
    assert_greedy_equals_transformers(
        gemma3_path, hf_oracle(gemma3_path), prompts, [14, 9, 16, 20, 11],
        async_scheduling=async_scheduling, block_size=4, num_kv_blocks=45,
        max_num_batched_tokens=16, max_num_seqs=5)


def test_a_config_written_before_transformers_5_reads_the_same(gemma3_path, tmp_path,
                                                               hf_oracle):
    """The hub's Gemma 3 configs: rope_theta and rope_local_base_freq, the layers from
    sliding_window_pattern."""
    path = _with_config(gemma3_path, tmp_path / "old",
                        drop=("rope_parameters", "layer_types"), rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, sliding_window_pattern=3)
    with LLM(path) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_oracle(gemma3_path).greedy(PROMPT, 12)


@pytest.mark.parametrize("field, value", [("attn_logit_softcapping", 50.0),
                                          ("use_bidirectional_attention", True),
                                          ("hidden_activation", "gelu")])
def test_a_field_raylm_cannot_honour_is_refused_by_name(gemma3_path, tmp_path, field, value):
    path = _with_config(gemma3_path, tmp_path / "bad", **{field: value})
    with pytest.raises(ValueError, match=field):
        LLM(path)
