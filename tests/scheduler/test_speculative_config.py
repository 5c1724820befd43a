"""SpeculativeConfig: vLLM's dict validated, each bad field named."""

from __future__ import annotations

import json

import pytest

from raylm.scheduler.config.speculative_config import SpeculativeConfig


def test_ngram_defaults_and_values():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert spec == SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=4)
    assert SpeculativeConfig.from_dict(None) is None


@pytest.mark.parametrize("config, field", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_step_overhead_tokens": 0},
     "draft_step_overhead_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_step_overhead_tokens": "8"},
     "draft_step_overhead_tokens"),
])
def test_invalid_configs_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(config)


def test_draft_model_vocab_must_match(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 99}))
    spec = SpeculativeConfig.from_dict(
        {"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path)})
    assert spec is not None and spec.model == str(tmp_path)
    with pytest.raises(ValueError, match="speculative_config.model .*vocab_size=99"):
        SpeculativeConfig.from_dict(spec, target_hf_config={"vocab_size": 100})
