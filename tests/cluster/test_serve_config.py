"""The pydantic serving config (cluster/serve/deployment/config.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from raylm.cluster.serve.deployment.config import (
    EngineKwargs,
    LLMConfig,
    OpenAIAppConfig,
    load_app_config,
)
from raylm.cluster.serve.deployment.deployment_config import (
    AutoscalingConfig,
    DeploymentConfig,
    PlacementGroupConfig,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "cluster" / "serve" / "example_config.yaml"
MINIMAL = {"model_loading_config": {"model_id": "m"}}


def _error_locs(exc: ValidationError) -> set[str]:
    return {".".join(map(str, e["loc"])) for e in exc.errors()}


def test_defaults():
    cfg = LLMConfig.model_validate(MINIMAL)
    assert cfg.model_id == "m" and cfg.model_loading_config.is_default
    ek = cfg.engine_kwargs
    assert (ek.tensor_parallel_size, ek.pipeline_parallel_size, ek.data_parallel_size) == (1, 1, 1)
    assert ek.to_llm_kwargs()["max_num_seqs"] == 128 and ek.async_scheduling is None
    auto = cfg.deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 1, 16)
    assert cfg.deployment_config.max_ongoing_requests == 64
    assert cfg.placement_group_config is None and cfg.accelerator_type is None
    assert not cfg.use_gpu and cfg.gpus_per_worker == 0
    assert cfg.api_key is None and cfg.runtime_env is None
    assert cfg.experimental_configs.stream_batching_interval_ms == 50.0


def test_example_config_loads_and_is_a_valid_serve_config():
    app = load_app_config(EXAMPLE)
    (cfg,) = app.llm_configs
    assert cfg.model_id == "raylm-demo" and cfg.model_loading_config.model_source == "demo"
    assert cfg.engine_kwargs.max_model_len == 512
    assert cfg.deployment_config.autoscaling_config.max_replicas == 2
    raw = yaml.safe_load(EXAMPLE.read_text())
    # The args dict alone and the whole file give the same config.
    assert load_app_config(raw["applications"][0]["args"]) == app
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ray.serve.schema import ServeDeploySchema
    serve = ServeDeploySchema.model_validate(raw)
    assert serve.applications[0].import_path == "raylm.cluster:build_openai_app"


def test_from_yaml_and_yaml_items(tmp_path):
    path = tmp_path / "llm.yaml"
    path.write_text(yaml.safe_dump({"model_loading_config": {"model_id": "a", "model_source": "/m"},
                                    "engine_kwargs": {"tensor_parallel_size": 2}}))
    cfg = LLMConfig.from_yaml(path)
    assert cfg.engine_kwargs.tensor_parallel_size == 2
    app = load_app_config({"llm_configs": [str(path), {"model_loading_config": {"model_id": "b"}}]})
    assert [c.model_id for c in app.llm_configs] == ["a", "b"]
    assert load_app_config(path).llm_configs == [cfg]  # a single LLMConfig file
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold one LLMConfig mapping"):
        LLMConfig.from_yaml(bad)


def test_load_app_config_accepts_objects_and_rejects_junk():
    cfg = LLMConfig.model_validate(MINIMAL)
    assert load_app_config(cfg).llm_configs == [cfg]
    app = OpenAIAppConfig(llm_configs=[cfg])
    assert load_app_config(app) is app
    assert load_app_config(MINIMAL).llm_configs == [cfg]
    with pytest.raises(ValueError, match="needs 'llm_configs'"):
        load_app_config({"models": []})
    with pytest.raises(ValueError, match="exactly one application"):
        load_app_config({"applications": [{"name": "x", "import_path": "other:app"}]})
    with pytest.raises(ValidationError) as e:
        load_app_config({"llm_configs": []})
    assert "llm_configs" in _error_locs(e.value)


@pytest.mark.parametrize("patch, loc", [
    ({"engine_kwargs": {"tensor_parallel_size": 0}}, "engine_kwargs.tensor_parallel_size"),
    ({"engine_kwargs": {"pipeline_parallel_size": -1}}, "engine_kwargs.pipeline_parallel_size"),
    ({"engine_kwargs": {"max_num_sequences": 8}}, "engine_kwargs.max_num_sequences"),
    ({"engine_kwargs": {"dtype": "int8"}}, "engine_kwargs.dtype"),
    ({"engine_kwargs": {"block_size": 24}}, "engine_kwargs.block_size"),
    ({"engine_kwargs": {"gpu_memory_utilization": 1.5}}, "engine_kwargs.gpu_memory_utilization"),
    ({"deployment_config": {"max_ongoing_requests": 0}}, "deployment_config.max_ongoing_requests"),
    ({"deployment_config": {"autoscaling_config": {"max_replicas": 0}}},
     "deployment_config.autoscaling_config.max_replicas"),
    ({"model_loading_config": {"model_id": ""}}, "model_loading_config.model_id"),
    ({"placement_group_config": {"bundles": [{"CPU": 1}], "strategy": "TIGHT"}},
     "placement_group_config.strategy"),
    ({"num_gpus_per_worker": -1}, "num_gpus_per_worker"),
    ({"api_keys": "x"}, "api_keys"),
    ({"experimental_configs": {"stream_batching_interval_ms": -5}},
     "experimental_configs.stream_batching_interval_ms"),
    ({"experimental_configs": {"num_ingress_replica": 2}},
     "experimental_configs.num_ingress_replica"),
])
def test_invalid_fields_name_the_field(patch, loc):
    data = {**MINIMAL, **patch}
    with pytest.raises(ValidationError) as e:
        LLMConfig.model_validate(data)
    assert loc in _error_locs(e.value), e.value
    assert loc in str(e.value)


@pytest.mark.parametrize("data, message", [
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas=3 must not exceed max_replicas=2"),
    ({"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5},
     "initial_replicas=5 must lie in [min_replicas=1, max_replicas=2]"),
])
def test_autoscaling_cross_field_errors(data, message):
    with pytest.raises(ValidationError, match=message.replace("[", r"\[")):
        AutoscalingConfig.model_validate(data)


def test_cross_field_errors_name_the_values():
    with pytest.raises(ValidationError, match="target_ongoing_requests=32.0 exceeds max_ongoing"):
        DeploymentConfig.model_validate({"max_ongoing_requests": 8,
                                         "autoscaling_config": {"target_ongoing_requests": 32}})
    with pytest.raises(ValidationError, match="num_replicas=2 and autoscaling_config are exclusive"):
        DeploymentConfig.model_validate({"num_replicas": 2, "autoscaling_config": {}})
    with pytest.raises(ValidationError, match="distributed_executor_backend='uni' cannot run"):
        EngineKwargs(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValidationError, match="num_gpus_per_worker=0"):
        LLMConfig.model_validate({**MINIMAL, "accelerator_type": "A10G", "num_gpus_per_worker": 0})
    with pytest.raises(ValidationError, match="has 2 bundles but .* need 3"):
        LLMConfig.model_validate({**MINIMAL, "engine_kwargs": {"tensor_parallel_size": 2,
                                                               "pipeline_parallel_size": 2},
                                  "placement_group_config": {"bundles": [{"CPU": 1}, {"GPU": 1}]}})
    with pytest.raises(ValidationError, match=r"bundles\[1\].*reserves no resource"):
        PlacementGroupConfig(bundles=[{"CPU": 1}, {"GPU": 0}])
    with pytest.raises(ValidationError, match=r"model_id \['m'\] appears more than once"):
        OpenAIAppConfig(llm_configs=[MINIMAL, MINIMAL])
    other = {**MINIMAL, "model_loading_config": {"model_id": "m2", "model_source": "/x"}}
    with pytest.raises(ValidationError, match="ingress_in_replica needs exactly one model.*got 2"):
        OpenAIAppConfig(llm_configs=[MINIMAL, other], ingress_in_replica=True)
    assert OpenAIAppConfig(llm_configs=[MINIMAL], ingress_in_replica=True).ingress_in_replica


def test_default_placement_group_tp2_pp2():
    ek = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    cpu = LLMConfig.model_validate({**MINIMAL, "engine_kwargs": ek})
    # The replica, then one bundle per pipeline stage holding its TP group.
    assert cpu.default_placement_group() == PlacementGroupConfig(
        bundles=[{"CPU": 1}, {"CPU": 2}, {"CPU": 2}], strategy="PACK")
    gpu = LLMConfig.model_validate({**MINIMAL, "engine_kwargs": ek, "num_gpus_per_worker": 1})
    assert gpu.use_gpu
    assert gpu.default_placement_group().bundles == [{"CPU": 1}] + [{"GPU": 2}] * 2
    typed = LLMConfig.model_validate({**MINIMAL, "engine_kwargs": ek, "accelerator_type": "H100"})
    assert typed.use_gpu and typed.gpus_per_worker == 1
    bundles = typed.default_placement_group().bundles
    assert bundles[0] == {"CPU": 1} and len(bundles) == 3
    assert all(b == {"GPU": 2, "accelerator_type:H100": 0.002} for b in bundles[1:])
    explicit = {"bundles": [{"CPU": 2}] + [{"GPU": 2}] * 2, "strategy": "STRICT_PACK"}
    pinned = LLMConfig.model_validate({**MINIMAL, "engine_kwargs": ek,
                                       "placement_group_config": explicit})
    assert pinned.get_placement_group().strategy == "STRICT_PACK"
    assert cpu.get_placement_group() == cpu.default_placement_group()
    # Ray Serve LLM's one-bundle-per-worker shape cannot hold a TP group per bundle.
    with pytest.raises(ValidationError, match=r"bundles\[1\]=\{'GPU': 1.0\} holds fewer GPUs "
                                              r"than the 2 its ranks need"):
        LLMConfig.model_validate({**MINIMAL, "engine_kwargs": ek, "num_gpus_per_worker": 1,
                                  "placement_group_config": {
                                      "bundles": [{"CPU": 1}] + [{"GPU": 1}] * 4}})


def test_default_placement_group_with_data_parallelism():
    # TP = PP = 1: each rank actor runs its model in one device bundle.
    dp2 = LLMConfig.model_validate({**MINIMAL, "engine_kwargs": {"data_parallel_size": 2},
                                    "num_gpus_per_worker": 1})
    assert dp2.default_placement_group().bundles == [{"CPU": 1}, {"GPU": 1}, {"GPU": 1}]
    # TP = 2: per rank, its EngineCore's CPU bundle, then its stage's two workers.
    dp2tp2 = LLMConfig.model_validate({**MINIMAL, "num_gpus_per_worker": 1, "engine_kwargs": {
        "data_parallel_size": 2, "tensor_parallel_size": 2}})
    rank = [{"CPU": 1}, {"GPU": 2}]
    assert dp2tp2.default_placement_group().bundles == [{"CPU": 1}] + rank + rank
    with pytest.raises(ValidationError, match=r"has 3 bundles but .*data_parallel_size=2 need 5"):
        LLMConfig.model_validate({**MINIMAL, "engine_kwargs": {
            "data_parallel_size": 2, "tensor_parallel_size": 2},
            "placement_group_config": {"bundles": [{"CPU": 1}] * 3}})


def test_serve_options_are_accepted_by_ray_serve():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig
        from ray.serve.schema import DeploymentSchema
    dc = DeploymentConfig.model_validate({
        "max_ongoing_requests": 32, "graceful_shutdown_timeout_s": 90,
        "autoscaling_config": {"min_replicas": 0, "max_replicas": 3, "initial_replicas": 1,
                               "target_ongoing_requests": 8, "downscale_delay_s": 120}})
    opts = dc.to_serve_options()
    ray_auto = RayAutoscalingConfig(**opts["autoscaling_config"])
    assert (ray_auto.min_replicas, ray_auto.max_replicas, ray_auto.initial_replicas) == (0, 3, 1)
    assert ray_auto.target_ongoing_requests == 8 and ray_auto.downscale_delay_s == 120
    schema = DeploymentSchema.model_validate({"name": "LLMServer", **opts})
    assert schema.max_ongoing_requests == 32 and schema.graceful_shutdown_timeout_s == 90
    fixed = DeploymentConfig(num_replicas=3).to_serve_options()
    assert fixed == {"max_ongoing_requests": 64, "num_replicas": 3}


def test_configs_are_frozen():
    cfg = LLMConfig.model_validate(MINIMAL)
    with pytest.raises(ValidationError):
        cfg.api_key = "x"  # type: ignore[misc]
    assert cfg.model_copy(update={"api_key": "k"}).api_key == "k"


def test_engine_kwargs_are_engine_arguments():
    """Every EngineKwargs key must be an argument the engine accepts (EngineArgs)."""
    from dataclasses import fields

    from raylm.cluster.engine.engine_args import EngineArgs

    accepted = {f.name for f in fields(EngineArgs)}
    assert set(EngineKwargs.model_fields) <= accepted, set(EngineKwargs.model_fields) - accepted


def test_model_source_resolution():
    from raylm.cluster.serve.deployment.config import ModelLoadingConfig

    real = ModelLoadingConfig(model_id="m", model_source="/models/m")
    assert not real.is_demo and real.resolve_model_source() == "/models/m"
    assert ModelLoadingConfig(model_id="m", model_source="demo").is_demo
    assert ModelLoadingConfig(model_id="m", model_source="demo-random").is_demo
    default = ModelLoadingConfig(model_id="m")
    assert default.is_default and not default.is_demo
