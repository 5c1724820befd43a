"""EngineArgs -> EngineConfig, async_scheduling resolved once (docs/architecture.md §3 rule 8),
and the three surfaces derived from EngineArgs' fields: LLM(...) keywords, CLI flags, the Serve
config's engine_kwargs."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import typing

import pytest
from pydantic import ValidationError

from raylm.cluster.cli import build_llm_config, build_parser
from raylm.cluster.engine.engine_args import EngineArgs, cli_engine_kwargs, engine_arg_types
from raylm.cluster.engine.llm import LLM
from raylm.cluster.serve.deployment.config import ENGINE_ARGS_ELSEWHERE, EngineKwargs, LLMConfig
from raylm.scheduler.config.engine_config import DTYPES

FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
# A value other than the default for every engine argument, as a CLI string and as Python.
NON_DEFAULTS = {
    "tokenizer": "/tok", "served_model_name": "mine", "dtype": "bfloat16",
    "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8,
    "enable_prefix_caching": False, "num_kv_blocks": 40, "kv_cache_memory_bytes": 1 << 20,
    "mamba_cache_mode": "all",
    "enforce_eager": True, "compile_fused_ops": True, "quantization": "none",
    "gpu_memory_utilization": 0.5,
    "seed": 7, "async_scheduling": False,
    "tensor_parallel_size": 2, "pipeline_parallel_size": 3, "data_parallel_size": 2,
    "distributed_executor_backend": "ray", "placement_group_strategy": "SPREAD",
    "placement_timeout_s": 60.0, "dp_sync_interval": 4, "cpu_burst_threads": 2,
    "enable_expert_parallel": True,
    "max_queued_requests": 5, "max_logprobs": 5, "max_n": 4, "max_stop_strings": 3,
    "max_stop_string_chars": 16, "max_logit_bias": 10, "max_structured_output_chars": 500,
    "grammar_compile_timeout_s": 2.5, "tool_call_parser": "hermes",
    "reasoning_parser": "qwen3",
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
    "kv_transfer_config": {"kv_connector": "OffloadingConnector",
                           "kv_connector_extra_config": {"num_cpu_blocks": 8}},
    "kv_offloading_size": 0.5,
    "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4,
    "lora_modules": ["sql=/adapters/sql", "chat=/adapters/chat"],
    "allowed_lora_root": "/adapters", "pooling_type": "mean",
}


def test_async_scheduling_is_resolved_once_by_the_config(llama_path):
    config = EngineArgs(model=llama_path).create_engine_config()
    assert config.scheduler_config.async_scheduling is True  # resolved at construction
    assert config.max_concurrent_batches == 2
    assert config.scheduler_config.max_model_len == config.model_config.max_model_len == 1024
    off = EngineArgs(model=llama_path, async_scheduling=False).create_engine_config()
    assert off.async_scheduling is False and off.max_concurrent_batches == 1


def test_async_false_forces_sync_and_pp_batches(llama_path):
    config = EngineArgs(model=llama_path, async_scheduling=False, pipeline_parallel_size=2)
    resolved = config.create_engine_config()
    assert resolved.async_scheduling is False and resolved.max_concurrent_batches == 2
    on = EngineArgs(model=llama_path, pipeline_parallel_size=2).create_engine_config()
    assert on.max_concurrent_batches == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "int8"}, "dtype"),
    ({"block_size": 12}, "block_size"),
    ({"max_model_len": 4096}, "max_model_len"),
    ({"max_model_len": -1}, "max_model_len"),
    ({"seed": -1}, "seed"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"placement_group_strategy": "RANDOM"}, "placement_group_strategy"),
    ({"quantization": "fp8"}, "quantization"),
    ({"quantization": "awq"}, "quantization"),
])
def test_bad_engine_args_name_the_value(llama_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=llama_path, **kwargs).create_engine_config()


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        EngineArgs(model=str(tmp_path)).create_engine_config()


# ---- one definition, three surfaces ----------------------------------------------------------

def test_every_field_has_help_and_a_non_default_example():
    assert set(NON_DEFAULTS) == set(FIELDS) - {"model"}
    for f in FIELDS.values():
        assert f.metadata.get("help"), f.name
        assert NON_DEFAULTS.get(f.name, None) != f.default, f.name


def test_llm_keywords_are_the_fields():
    params = inspect.signature(LLM.__init__).parameters
    assert list(params)[1] == "model"
    assert any(p.kind is p.VAR_KEYWORD for p in params.values())
    assert EngineArgs.from_kwargs("/m", **NON_DEFAULTS).to_dict() == {"model": "/m",
                                                                      **NON_DEFAULTS}
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_sequences'\]"):
        EngineArgs.from_kwargs("/m", max_num_sequences=8)


def _flag(name: str, value: object) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, json.dumps(value) if isinstance(value, dict) else str(value)]


@pytest.mark.parametrize("command", ["serve", "generate", "batch"])
def test_cli_flags_are_the_fields(command):
    positional = {"serve": [], "generate": ["hi"], "batch": ["-i", "in", "-o", "out"]}[command]
    argv = [command, *positional]
    for name, value in NON_DEFAULTS.items():
        argv += _flag(name, value)
    args = build_parser().parse_args(argv)
    assert cli_engine_kwargs(args) == NON_DEFAULTS
    assert cli_engine_kwargs(build_parser().parse_args([command, *positional])) == {}
    # Choices come from the same definition as the config's check.
    action = next(a for a in build_parser()._subparsers._group_actions[0]
                  .choices[command]._actions if a.dest == "dtype")
    assert tuple(action.choices) == DTYPES
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, *positional, "--dtype", "int8"])


def test_short_parallel_flags():
    args = build_parser().parse_args(["serve", "-tp", "2", "-pp", "3", "-dp", "4"])
    assert cli_engine_kwargs(args) == {"tensor_parallel_size": 2, "pipeline_parallel_size": 3,
                                       "data_parallel_size": 4}


def test_serve_engine_kwargs_are_the_fields():
    assert set(EngineKwargs.model_fields) | set(ENGINE_ARGS_ELSEWHERE) == set(FIELDS)
    assert not set(EngineKwargs.model_fields) & set(ENGINE_ARGS_ELSEWHERE)
    hints = typing.get_type_hints(EngineArgs)
    for name, info in EngineKwargs.model_fields.items():
        assert info.default == FIELDS[name].default, name
        assert info.annotation == hints[name], name
        assert info.description == FIELDS[name].metadata["help"], name
    assert EngineKwargs().to_llm_kwargs() == {
        n: f.default for n, f in FIELDS.items() if n not in ENGINE_ARGS_ELSEWHERE}


def test_cli_and_serve_config_give_the_replica_the_same_engine_args(llama_path):
    """Every engine argument given as a flag reaches the EngineArgs a Serve replica builds."""
    # The replica's config is checked against the (dense) checkpoint: expert parallelism
    # is refused there (tests/cluster/test_moe.py), so it is left at its default.
    given = {k: v for k, v in NON_DEFAULTS.items() if k != "enable_expert_parallel"}
    argv = ["serve", llama_path]
    for name, value in given.items():
        argv += _flag(name, value)
    sent = build_llm_config(build_parser().parse_args(argv))
    config = LLMConfig.model_validate_json(sent.model_dump_json())  # what the replica gets
    assert config.engine_args() == EngineArgs(model=llama_path, **given)
    assert config.get_placement_group().strategy == "SPREAD"


@pytest.mark.parametrize("key, value, message", [
    ("block_size", 24, "block_size must be a positive power of two, got 24"),
    ("seed", -3, "seed must be non-negative, got -3"),
    ("dp_sync_interval", 0, "dp_sync_interval must be at least 1, got 0"),
    ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
])
def test_serve_config_values_are_checked_by_the_engine_config(key, value, message):
    with pytest.raises(ValidationError, match=message) as e:
        EngineKwargs(**{key: value})
    assert [err["loc"] for err in e.value.errors()] == [(key,)]


def _number_type(name: str) -> type | None:
    annotation = engine_arg_types()[name]
    members = set(typing.get_args(annotation)) | {annotation}
    return next((t for t in (int, float) if t in members), None)


NUMERIC = [name for name in FIELDS if _number_type(name) is not None]


def _accepted(name: str, value: float) -> bool:
    try:
        EngineArgs(model="", **{name: value}).check_without_checkpoint()
    except ValueError as e:
        assert name in str(e), f"{name}={value!r} refused for another reason: {e}"
        return False
    return True


@pytest.mark.parametrize("name", NUMERIC)
def test_each_stated_bound_is_where_the_engine_configs_start_refusing(name):
    """The bounds the Helm schema states (EngineArgs metadata) are the engine's own: the
    bound itself is accepted, one step past it refused, by the frozen configs."""
    bounds = FIELDS[name].metadata["bounds"]
    assert bounds, f"numeric engine argument {name} states no bounds (_arg(..., bounds=...))"
    step = 1 if _number_type(name) is int else 0.01
    seen = []
    if "minimum" in bounds:
        seen += [_accepted(name, bounds["minimum"]), not _accepted(name, bounds["minimum"] - step)]
    if "exclusiveMinimum" in bounds:
        low = bounds["exclusiveMinimum"]
        seen += [not _accepted(name, low), _accepted(name, low + step)]
    if "maximum" in bounds:
        seen += [_accepted(name, bounds["maximum"]), not _accepted(name, bounds["maximum"] + step)]
    assert seen and all(seen), (name, bounds, seen)
    assert set(bounds) <= {"minimum", "exclusiveMinimum", "maximum"}, bounds


def test_numeric_arguments_are_found_whether_optional_or_not():
    assert {"max_model_len", "max_num_seqs", "gpu_memory_utilization", "seed"} <= set(NUMERIC)
    assert not {"enable_prefix_caching", "async_scheduling", "dtype"} & set(NUMERIC)


def test_an_incompatible_option_turns_auto_off_and_refuses_true(llama_path, monkeypatch, caplog):
    from raylm.scheduler.config.engine_config import EngineConfig

    monkeypatch.setattr(EngineConfig, "async_scheduling_incompatibility",
                        lambda self: "some_option=on")
    with caplog.at_level(logging.INFO, logger="raylm.scheduler.config.engine_config"):
        auto = EngineArgs(model=llama_path).create_engine_config()
    assert auto.async_scheduling is False and auto.max_concurrent_batches == 1
    assert "Async scheduling disabled: not supported with some_option=on" in caplog.text
    with pytest.raises(ValueError, match="async_scheduling=True is not supported with some_opt"):
        EngineArgs(model=llama_path, async_scheduling=True).create_engine_config()
    off = EngineArgs(model=llama_path, async_scheduling=False).create_engine_config()
    assert off.async_scheduling is False
    with pytest.raises(ValidationError, match="some_option=on"):  # at Serve config load
        EngineKwargs(async_scheduling=True)


def test_speculative_config_reaches_the_engine_config(llama_path):
    args = EngineArgs.from_kwargs(llama_path, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3})
    config = args.create_engine_config()
    assert config.speculative_config is not None and config.num_spec_tokens == 3
    with pytest.raises(ValueError, match="speculative_config.method"):
        EngineArgs(model=llama_path, speculative_config={
            "method": "medusa", "num_speculative_tokens": 3}).create_engine_config()


def test_speculation_with_pp_runs_async_by_default(llama_path):
    """The PP ring carries accepted runs: speculation with PP schedules asynchronously
    (pp_size + 1 batches in flight) unless asked not to."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    config = EngineArgs(model=llama_path, pipeline_parallel_size=2,
                        speculative_config=spec).create_engine_config()
    assert config.async_scheduling is True and config.max_concurrent_batches == 3
    draft = EngineArgs(model=llama_path, pipeline_parallel_size=2, async_scheduling=False,
                       speculative_config={"method": "draft_model", "model": llama_path,
                                           "num_speculative_tokens": 2}).create_engine_config()
    assert draft.async_scheduling is False and draft.max_concurrent_batches == 2
