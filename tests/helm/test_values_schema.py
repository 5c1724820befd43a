"""values.schema.json and values.yaml stay in step with raylm's LLMConfig."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import Field, create_model

from raylm.cluster.serve.deployment.config import EngineKwargs, LLMConfig, ModelLoadingConfig
from raylm.cluster.serve.deployment.deployment_config import (
    AutoscalingConfig,
    DeploymentConfig,
    ExperimentalConfigs,
)

CHART = Path(__file__).resolve().parents[2] / "helm" / "raylm"


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _generator():
    """helm/generate_schema.py (a script beside the chart, not a package module)."""
    spec = importlib.util.spec_from_file_location("generate_schema",
                                                  CHART.parent / "generate_schema.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_kwargs_schema_is_the_generated_one():
    problem = _generator().out_of_date()
    if problem is not None:
        pytest.fail(problem)


def test_a_new_engine_argument_fails_until_the_schema_is_regenerated():
    generator = _generator()
    grown = create_model("EngineKwargs", __base__=EngineKwargs,
                         max_new_thing=(int, Field(default=4, description="a new argument",
                                                   json_schema_extra={"minimum": 2})))
    assert generator.out_of_date(grown) == (
        "helm/raylm/values.schema.json: engine_kwargs is out of date with raylm's engine "
        "arguments (cluster/engine/engine_args.py): run `python helm/generate_schema.py` and "
        "commit the result.")
    regenerated = json.loads(generator.render(grown))
    node = regenerated["properties"]["llmConfig"]["properties"]["engine_kwargs"]
    assert node["properties"]["max_new_thing"] == {
        "type": "integer", "minimum": 2, "description": "a new argument"}
    # Everything else in the file stays as committed.
    del node["properties"]["max_new_thing"]
    assert regenerated == _schema()


def test_generated_engine_kwargs_schema_forms():
    """Optional values as type lists, choices as enums (with null when optional), the
    engine arguments' help and bounds carried over."""
    props = _schema()["properties"]["llmConfig"]["properties"]["engine_kwargs"]["properties"]
    assert props["max_num_batched_tokens"] == {
        "type": ["integer", "null"], "minimum": 1,
        "description": "most tokens in one step (default: max(2048, max_num_seqs))"}
    assert props["gpu_memory_utilization"]["exclusiveMinimum"] == 0
    assert props["gpu_memory_utilization"]["maximum"] == 1
    assert props["dtype"]["enum"] == ["auto", "float32", "bfloat16", "float16", "float64"]
    assert "type" not in props["dtype"]
    assert props["distributed_executor_backend"]["enum"] == ["uni", "ray", None]
    assert props["speculative_config"]["type"] == ["object", "null"]


def test_schema_is_draft7_and_accepts_the_defaults():
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(_values())]
    assert errors == []


def test_llm_config_schema_mirrors_the_pydantic_models():
    llm = _schema()["properties"]["llmConfig"]
    pairs = [
        (llm, LLMConfig),
        (llm["properties"]["model_loading_config"], ModelLoadingConfig),
        (llm["properties"]["engine_kwargs"], EngineKwargs),
        (llm["properties"]["deployment_config"], DeploymentConfig),
        (llm["properties"]["deployment_config"]["properties"]["autoscaling_config"],
         AutoscalingConfig),
        (llm["properties"]["experimental_configs"], ExperimentalConfigs),
    ]
    # Ray Serve LLM's lora_config, which LLMConfig reads into engine_kwargs (migration).
    ray_keys = {LLMConfig: {"lora_config"}}
    for node, model in pairs:
        assert set(node["properties"]) == set(model.model_fields) | ray_keys.get(model, set()), \
            model.__name__
        assert node["additionalProperties"] is False, model.__name__


def test_default_llm_config_is_a_valid_llmconfig():
    cfg = LLMConfig.model_validate(_values()["llmConfig"])
    assert cfg.model_id == "raylm-demo"
    assert cfg.engine_kwargs.world_size == 1


def test_schema_rejects_what_pydantic_rejects():
    validator = jsonschema.Draft7Validator(_schema())
    values = _values()
    values["llmConfig"]["engine_kwargs"]["pipeline_parallel_size"] = 0
    values["llmConfig"]["deployment_config"]["autoscaling_config"]["max_replicas"] = 0
    paths = {"/".join(map(str, e.absolute_path)) for e in validator.iter_errors(values)}
    assert paths == {"llmConfig/engine_kwargs/pipeline_parallel_size",
                     "llmConfig/deployment_config/autoscaling_config/max_replicas"}
