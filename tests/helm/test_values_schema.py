"""values.schema.json and values.yaml stay in step with raylm's LLMConfig."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

from raylm.cluster.serve_config import (
    AutoscalingConfig,
    DeploymentConfig,
    EngineKwargs,
    ExperimentalConfigs,
    LLMConfig,
    ModelLoadingConfig,
)

CHART = Path(__file__).resolve().parents[2] / "helm" / "raylm"


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


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
    for node, model in pairs:
        assert set(node["properties"]) == set(model.model_fields), model.__name__
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
