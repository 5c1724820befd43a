"""Sliding-window attention (Mistral, Qwen2/Qwen3 with use_sliding_window): the windowed
layers read from config.json as transformers reads them, and the tokens equal
transformers' with chunked prefill, prefix caching and preemption, sync and async."""

from __future__ import annotations

import json
import shutil

import pytest
from family_check import assert_greedy_equals_transformers

from raylm import LLM, SamplingParams
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.scheduler.config.attention_layout import layer_windows

QWEN2, QWEN3, LLAMA = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"


W = 8


@pytest.mark.parametrize(("arch", "fields", "expected"), [
    (QWEN2, {}, [None] * 4),
    (QWEN2, {"use_sliding_window": False, "sliding_window": W, "max_window_layers": 0},
     [None] * 4),
    (QWEN2, {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1},
     [None, W, W, W]),
    (QWEN2, {"use_sliding_window": True, "sliding_window": W}, [None] * 4),  # default 28
    (QWEN2, {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
     [None] * 4),
    (QWEN3, {"use_sliding_window": True, "sliding_window": W,
             "layer_types": ["full_attention", "sliding_attention"] * 2}, [None, W, None, W]),
    # transformers gives a "sliding_attention" layer no window unless use_sliding_window
    (QWEN3, {"sliding_window": W, "layer_types": ["sliding_attention"] * 4}, [None] * 4),
    (LLAMA, {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 0},
     [None] * 4),
    (MISTRAL, {"sliding_window": W}, [W] * 4),
    (MISTRAL, {"sliding_window": None}, [None] * 4),
    (MISTRAL, {}, [4096] * 4),  # transformers' default
])
def test_the_windowed_layers_are_those_transformers_windows(arch, fields, expected):
    assert layer_windows(arch, {"num_hidden_layers": 4, **fields}) == expected


@pytest.mark.parametrize(("arch", "fields", "match"), [
    (QWEN3, {"layer_types": ["full_attention", "linear_attention"]},
     r"layer_types \['linear_attention'\]"),
    (QWEN3, {"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    (MISTRAL, {"sliding_window": 0}, "sliding_window must be a positive integer"),
    (QWEN2, {"use_sliding_window": True, "sliding_window": "8", "max_window_layers": 0},
     "sliding_window must be a positive integer"),
])
def test_a_layout_raylm_cannot_run_is_refused_by_name(arch, fields, match):
    with pytest.raises(ValueError, match=match):
        layer_windows(arch, {"num_hidden_layers": 2, **fields})


def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("layer_types", None)  # as a hub Qwen2 config: the window fields alone
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


PROMPT = list(range(40, 72))  # 32 tokens: far beyond a 5-token window


@pytest.fixture(scope="module")
def windowed_paths(tmp_path_factory) -> dict[str, str]:
    """Mistral with a 5-token window on every layer; Qwen2 with one on its second layer."""
    root = tmp_path_factory.mktemp("windowed")
    specs = {"mistral": CheckpointSpec(architecture="MistralForCausalLM", sliding_window=5,
                                       seed=21),
             "qwen2": CheckpointSpec(architecture="Qwen2ForCausalLM", sliding_window=5,
                                     max_window_layers=1, seed=22)}
    return {name: write_random_checkpoint(str(root / name), spec)
            for name, spec in specs.items()}


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_the_window_changes_the_models_tokens(windowed_paths, family, tmp_path, hf_oracle):
    """Without its window the same weights give other tokens: the tests below can fail."""
    path = windowed_paths[family]
    fields = ({"sliding_window": None} if family == "mistral"
              else {"use_sliding_window": False})
    unwindowed = _with_config(path, tmp_path / "full", **fields)
    assert hf_oracle(path).greedy(PROMPT, 12) != hf_oracle(unwindowed).greedy(PROMPT, 12)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_models_equal_transformers(windowed_paths, family, async_scheduling,
                                                  hf_oracle):
    """Chunked prefill, prefix hits (a shared 20-token start) and preemption, decode rows
    and prefill spans in one step. Mistral (every layer windowed) frees the blocks behind
    its window as requests grow: its pool is a third of Qwen2's, and still preempts only
    with an 8-token budget (fewer tokens in flight, less to hold beyond the window)."""
    path = windowed_paths[family]
    shared = list(range(100, 120))
    prompts = [shared + [7, 8, 9], shared + list(range(200, 230)), PROMPT, [5, 6],
               list(range(300, 341))]
    pool = ({"num_kv_blocks": 9, "max_num_batched_tokens": 8} if family == "mistral"
            else {"num_kv_blocks": 30, "max_num_batched_tokens": 16})
    assert_greedy_equals_transformers(
        path, hf_oracle(path), prompts, [14, 9, 16, 20, 11], async_scheduling=async_scheduling,
        block_size=4, max_num_seqs=5, **pool)


def test_a_window_on_no_layer_runs_and_equals_transformers(qwen2_path, tmp_path, hf_oracle):
    # max_window_layers = the layer count: transformers windows no layer.
    path = _with_config(qwen2_path, tmp_path / "unwindowed", use_sliding_window=True,
                        sliding_window=4, max_window_layers=2)
    with LLM(path) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_oracle(path).greedy(PROMPT, 12)


def test_ngram_speculation_on_a_windowed_model_under_async_equals_transformers(
        windowed_paths, hf_oracle):
    """Verified drafts are rows of several tokens through the ragged kernel, each draft
    position with its own window; a repeating prompt makes the lookup propose."""
    path = windowed_paths["mistral"]
    prompts = [[11, 12, 13, 14] * 6, PROMPT]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    with LLM(path, async_scheduling=True, block_size=4, speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        metrics = llm.get_metrics()
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_oracle(path).greedy(p, 16)
    assert metrics["raylm:spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize(("async_scheduling", "ngram"), [(False, False), (True, False),
                                                         (True, True)],
                         ids=["sync", "async", "async-ngram"])
def test_requests_longer_than_the_pool_run_as_the_window_frees_their_blocks(
        windowed_paths, hf_oracle, async_scheduling, ngram):
    """Mistral's window (5) is on every layer: a request keeps only the blocks its next
    tokens can read. Two requests of ~150 tokens (38 blocks of 4 each) run in a pool of 16
    and equal transformers, with ngram drafts rolled back under async (a block is freed
    only behind the settled tokens, never behind drafts that may be rejected)."""
    path = windowed_paths["mistral"]
    prompts = [PROMPT, [11, 12, 13, 14] * 6]
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3} if ngram else None)
    with LLM(path, async_scheduling=async_scheduling, block_size=4, num_kv_blocks=16,
             max_num_batched_tokens=16, speculative_config=spec) as llm:
        core = llm.llm_engine.core.engine_core
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        kv = core.scheduler.kv_cache_manager
        metrics = llm.get_metrics()
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_oracle(path).greedy(p, 120)
    assert kv.num_window_freed_blocks >= 2 * (38 - 16)
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0
    if ngram:
        assert metrics["raylm:spec_decode_num_draft_tokens"] > 0


def test_the_windowed_layer_of_a_mixed_model_frees_its_blocks_the_full_one_keeps_them(
        windowed_paths, hf_oracle):
    """Qwen2 here windows one layer of two: two KV cache groups of one layer each. The
    full group keeps every block (38 for 152 tokens), the windowed one its window's and
    what is in flight (14 at most): a request needing 58 + 14 blocks is refused by that
    count, one needing 38 + 14 runs in a pool of 56 (the whole table would hold 76), its
    windowed group's blocks freed as it grows, and equals transformers."""
    path = windowed_paths["qwen2"]
    with LLM(path, block_size=4, num_kv_blocks=56, max_num_batched_tokens=16) as llm:
        kv = llm.llm_engine.core.engine_core.scheduler.kv_cache_manager
        assert kv.group_windows == (None, 5)
        with pytest.raises(ValueError, match="needs 72 KV blocks .* pool holds only 56"):
            llm.generate([{"prompt_token_ids": PROMPT}],
                         SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        metrics = llm.get_metrics()
    assert out[0].outputs[0].token_ids == hf_oracle(path).greedy(PROMPT, 120)
    assert kv.num_window_freed_blocks >= 38 - 14
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0
