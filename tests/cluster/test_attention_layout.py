"""Sliding-window fields of a checkpoint's config.json: raylm runs full attention on every
layer, so a config that puts a window on any layer is refused, naming the field, and one
whose window falls on no layer runs and equals transformers."""

from __future__ import annotations

import json
import shutil

import pytest

from raylm import LLM, SamplingParams
from raylm.scheduler.config.attention_layout import windowed_layers

QWEN2, QWEN3, LLAMA = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"


@pytest.mark.parametrize(("arch", "fields", "expected"), [
    (QWEN2, {}, []),
    (QWEN2, {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}, []),
    (QWEN2, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, [1, 2, 3]),
    (QWEN2, {"use_sliding_window": True, "sliding_window": 8}, []),  # default 28 >= 4 layers
    (QWEN2, {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}, []),
    (QWEN3, {"use_sliding_window": True, "sliding_window": 8,
             "layer_types": ["full_attention", "sliding_attention"] * 2}, [1, 3]),
    # transformers gives a "sliding_attention" layer no window unless use_sliding_window
    (QWEN3, {"sliding_window": 8, "layer_types": ["sliding_attention"] * 4}, []),
    (LLAMA, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, []),
])
def test_the_windowed_layers_are_those_transformers_windows(arch, fields, expected):
    assert windowed_layers(arch, {"num_hidden_layers": 4, **fields}) == expected


def test_an_unknown_layer_kind_is_refused_by_name():
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\]"):
        windowed_layers(QWEN3, {"num_hidden_layers": 2,
                                "layer_types": ["full_attention", "linear_attention"]})


def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("layer_types", None)  # as a hub Qwen2 config: the window fields alone
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


PROMPT = list(range(40, 72))  # 32 tokens: far beyond a 4-token window


def test_a_windowed_qwen2_is_refused_naming_the_field(qwen2_path, tmp_path, hf_oracle):
    windowed = _with_config(qwen2_path, tmp_path / "windowed", use_sliding_window=True,
                            sliding_window=4, max_window_layers=1)
    # The window changes the model's tokens: running it with full attention would be wrong.
    assert hf_oracle(windowed).greedy(PROMPT, 12) != hf_oracle(qwen2_path).greedy(PROMPT, 12)
    with pytest.raises(ValueError, match=r"use_sliding_window=True with sliding_window=4 on "
                                         r"layers \[1\].*max_window_layers"):
        LLM(windowed)


def test_a_window_on_no_layer_runs_and_equals_transformers(qwen2_path, tmp_path, hf_oracle):
    # max_window_layers = the layer count: transformers windows no layer.
    path = _with_config(qwen2_path, tmp_path / "unwindowed", use_sliding_window=True,
                        sliding_window=4, max_window_layers=2)
    with LLM(path) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_oracle(path).greedy(PROMPT, 12)
