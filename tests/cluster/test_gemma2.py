"""Gemma 2: Gemma 3's norms, scaled embedding and GELU without q/k norms, one RoPE table,
sliding and global layers alternating, and soft-capped attention scores
(``attn_logit_softcapping``) as well as logits, against transformers' Gemma2ForCausalLM
under the engine's hardest bookkeeping (the scores capped in the prefill path, the CPU
kernel and the torch kernel alike); fields raylm cannot honour refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
from family_check import assert_greedy_equals_transformers

from raylm import LLM, SamplingParams
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

PROMPT = list(range(40, 72))  # 32 tokens: far beyond the 5-token window
# A cap this low bites on the random model's scores (Gemma 2 ships 50.0 for real ones).
CAP = 0.5


@pytest.fixture(scope="module")
def gemma2_path(tmp_path_factory) -> str:
    """3 layers: 0 and 2 sliding (5 tokens), 1 global."""
    spec = CheckpointSpec(architecture="Gemma2ForCausalLM", num_hidden_layers=3,
                          sliding_window=5, head_dim=16, final_logit_softcapping=30.0,
                          attn_logit_softcapping=CAP, seed=38)
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gemma2") / "m"), spec)


def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_the_cap_and_the_window_change_the_models_tokens(gemma2_path, tmp_path, hf_oracle):
    reference = hf_oracle(gemma2_path).greedy(PROMPT, 12)
    uncapped = _with_config(gemma2_path, tmp_path / "uncapped", attn_logit_softcapping=None)
    full = _with_config(gemma2_path, tmp_path / "full", layer_types=["full_attention"] * 3)
    assert hf_oracle(uncapped).greedy(PROMPT, 12) != reference
    assert hf_oracle(full).greedy(PROMPT, 12) != reference


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_gemma2_equals_transformers(gemma2_path, async_scheduling, hf_oracle):
    """Chunked prefill (a 16-token budget), prefix hits (a shared 20-token start) and
    preemption (45 blocks of 4 tokens; the layers are three KV cache groups of one layer
    each, so a block is one layer's page)."""
    shared = list(range(100, 120))
    prompts = [shared + [7, 8, 9], shared + list(range(200, 230)), PROMPT, [5, 6],
               list(range(300, 341))]
    assert_greedy_equals_transformers(
        gemma2_path, hf_oracle(gemma2_path), prompts, [14, 9, 16, 20, 11],
        async_scheduling=async_scheduling, block_size=4, num_kv_blocks=45,
        max_num_batched_tokens=16, max_num_seqs=5)


def test_the_torch_kernel_caps_the_scores_too(gemma2_path, hf_oracle, monkeypatch):
    """RAYLM_CPU_ATTENTION_KERNEL=0: decode through the torch ragged kernel."""
    monkeypatch.setenv("RAYLM_CPU_ATTENTION_KERNEL", "0")
    from raylm.runner.attention import cpu_kernel

    cpu_kernel.load_cpu_attention_kernel.cache_clear()
    try:
        with LLM(gemma2_path, block_size=4) as llm:
            out = llm.generate([{"prompt_token_ids": PROMPT}],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    finally:
        cpu_kernel.load_cpu_attention_kernel.cache_clear()
    assert out[0].outputs[0].token_ids == hf_oracle(gemma2_path).greedy(PROMPT, 12)


@pytest.mark.parametrize("field, value", [("attn_logit_softcapping", -1.0),
                                          ("final_logit_softcapping", -2.0),
                                          ("use_bidirectional_attention", True),
                                          ("hidden_activation", "gelu"),
                                          ("layer_types", ["chunked_attention"] * 3)])
def test_a_field_raylm_cannot_honour_is_refused_by_name(gemma2_path, tmp_path, field, value):
    path = _with_config(gemma2_path, tmp_path / "bad", **{field: value})
    with pytest.raises(ValueError, match=field):
        LLM(path)
