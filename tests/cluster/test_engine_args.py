"""EngineArgs -> EngineConfig, and the async_scheduling resolution rules (docs/architecture.md §3 rule 8)."""

from __future__ import annotations

import logging

import pytest

from raylm.cluster.engine_args import EngineArgs


def test_defaults_resolve_async_on(llama_path):
    config = EngineArgs(model=llama_path).create_engine_config().resolve_async_scheduling(True)
    assert config.async_scheduling is True
    assert config.max_concurrent_batches == 2
    assert config.scheduler_config.max_model_len == config.model_config.max_model_len == 1024


def test_async_falls_back_with_a_log_line_when_incompatible(llama_path, caplog):
    config = EngineArgs(model=llama_path).create_engine_config()
    with caplog.at_level(logging.INFO):
        resolved = config.resolve_async_scheduling(executor_supports_async=False)
    assert resolved.async_scheduling is False and resolved.max_concurrent_batches == 1
    assert "Async scheduling disabled" in caplog.text


def test_async_true_with_incompatible_option_is_a_hard_error(llama_path):
    config = EngineArgs(model=llama_path, async_scheduling=True).create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        config.resolve_async_scheduling(executor_supports_async=False)


def test_async_false_forces_sync_and_pp_batches(llama_path):
    config = EngineArgs(model=llama_path, async_scheduling=False, pipeline_parallel_size=2)
    resolved = config.create_engine_config().resolve_async_scheduling(True)
    assert resolved.async_scheduling is False and resolved.max_concurrent_batches == 2
    on = EngineArgs(model=llama_path, pipeline_parallel_size=2).create_engine_config()
    assert on.resolve_async_scheduling(True).max_concurrent_batches == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "int8"}, "dtype"),
    ({"block_size": 12}, "block_size"),
    ({"max_model_len": 4096}, "max_model_len"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"placement_group_strategy": "RANDOM"}, "placement_group_strategy"),
])
def test_bad_engine_args_name_the_value(llama_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=llama_path, **kwargs).create_engine_config()


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        EngineArgs(model=str(tmp_path)).create_engine_config()
