"""Configs written for Ray Serve LLM and vLLM: the shapes of Ray's documented `serve run`
examples load once import_path names raylm's builder; vLLM's engine arguments with a meaning
here are accepted under their names (each mapped, accepted because raylm already does what
it asks, or refused saying why); every key raylm does not implement is named in one error."""

from __future__ import annotations

import warnings

import pytest
import yaml
from pydantic import ValidationError

from raylm.cluster.engine.engine_args import EngineArgs
from raylm.cluster.engine.vllm_args import VLLM_ARGS
from raylm.cluster.serve.deployment.config import LLMConfig, OpenAIAppConfig, load_app_config

RAYLM = "raylm.cluster:build_openai_app"
# The shape of Ray's single-model example: a Hub model, an accelerator type, autoscaling,
# vLLM engine_kwargs (a Hub token among them).
ONE_MODEL = """
applications:
- name: my-llm-app
  route_prefix: "/"
  import_path: ray.serve.llm:build_openai_app
  args:
    llm_configs:
      - model_loading_config:
          model_id: my-model
          model_source: some-org/Some-Model-8B-Instruct
        accelerator_type: L4
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
        engine_kwargs:
          max_model_len: 8192
          hf_token: hf_not_a_real_token
"""
# The shape of Ray's two-model example (the application's keys in the other order).
TWO_MODELS = """
applications:
- args:
    llm_configs:
        - model_loading_config:
            model_id: small
            model_source: some-org/Small-0.5B-Instruct
          accelerator_type: A10G
          deployment_config:
            autoscaling_config:
                min_replicas: 1
                max_replicas: 2
        - model_loading_config:
            model_id: large
            model_source: some-org/Large-1.5B-Instruct
          accelerator_type: A10G
          deployment_config:
            autoscaling_config:
                min_replicas: 1
                max_replicas: 2
  import_path: ray.serve.llm:build_openai_app
  name: llm_app
  route_prefix: "/"
"""
# Engine arguments as Ray's docs pass them for tool calling and reasoning models.
AGENT_MODEL = """
applications:
  - name: agents
    route_prefix: /
    import_path: ray.serve.llm:build_openai_app
    runtime_env:
      env_vars: {SOME_FLAG: "1"}
    args:
      llm_configs:
        - model_loading_config: {model_id: agent, model_source: /models/agent}
          deployment_config: {autoscaling_config: {min_replicas: 1, max_replicas: 4}}
          log_engine_metrics: true
          llm_engine: vLLM
          engine_kwargs:
            trust_remote_code: true
            tensor_parallel_size: 1
            enable_chunked_prefill: true
            max_num_batched_tokens: 4096
            enable_prefix_caching: true
            gpu_memory_utilization: 0.85
            enforce_eager: true
            max_logprobs: 10
            enable_auto_tool_choice: true
            tool_call_parser: hermes
            reasoning_parser: qwen3
"""


def _with_raylm(text: str) -> dict:
    config = yaml.safe_load(text)
    for app in config["applications"]:
        app["import_path"] = RAYLM  # the one change
    return config


@pytest.mark.parametrize("text, ids", [(ONE_MODEL, ["my-model"]),
                                       (TWO_MODELS, ["small", "large"]),
                                       (AGENT_MODEL, ["agent"])])
def test_rays_documented_configs_load_after_changing_import_path(text, ids):
    config = _with_raylm(text)
    app = load_app_config(config)
    assert [c.model_id for c in app.llm_configs] == ids
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ray.serve.schema import ServeDeploySchema
    ServeDeploySchema.model_validate(config)
    for cfg in app.llm_configs:
        assert cfg.deployment_config.autoscaling_config.max_replicas in (2, 4)
        # What the replica receives round-trips (the Ray-only keys are gone by then).
        again = LLMConfig.model_validate_json(cfg.model_dump_json(exclude_unset=True))
        assert again == cfg
    if text is ONE_MODEL:
        (cfg,) = app.llm_configs
        assert cfg.accelerator_type == "L4" and cfg.engine_kwargs.max_model_len == 8192
    if text is AGENT_MODEL:
        ek = app.llm_configs[0].engine_kwargs
        assert (ek.max_num_batched_tokens, ek.enable_prefix_caching, ek.enforce_eager) == (
            4096, True, True)
        assert (ek.gpu_memory_utilization, ek.max_logprobs) == (0.85, 10)
        assert (ek.tool_call_parser, ek.reasoning_parser) == ("hermes", "qwen3")


def test_tokenizer_source_maps_to_the_engines_tokenizer():
    cfg = LLMConfig.model_validate({"model_loading_config": {
        "model_id": "m", "model_source": "/models/m", "tokenizer_source": "/models/tok"}})
    assert cfg.engine_kwargs.tokenizer == "/models/tok"


def test_every_unimplemented_ray_key_is_named_in_one_error():
    data = {
        "model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "s3://b/m"}},
        "lora_config": {"max_num_adapters_per_replica": 4, "download_timeout_s": 10},
        "log_engine_metrics": False,
        "llm_engine": "SGLang",
        "server_cls": "my.Server",
        "placement_group_config": {"bundle_per_worker": {"GPU": 1}},
        "experimental_configs": {"num_ingress_replicas": 2},
        "deployment_config": {"ray_actor_options": {"num_cpus": 2},
                              "autoscaling_config": {"upscaling_factor": 2.0}},
        "engine_kwargs": {"enable_chunked_prefill": False, "disable_custom_all_reduce": False,
                          "kv_cache_dtype": "fp8", "made_up_key": 1},
        "also_made_up": 2,
    }
    with pytest.raises(ValidationError) as e:
        LLMConfig.model_validate(data)
    errors = e.value.errors()
    assert len(errors) == 1
    message = errors[0]["msg"]
    for key in ("lora_config.download_timeout_s", "log_engine_metrics=False", "llm_engine='SGLang'", "server_cls",
                "model_loading_config.model_source", "placement_group_config.bundle_per_worker",
                "experimental_configs.num_ingress_replicas",
                "deployment_config.ray_actor_options",
                "deployment_config.autoscaling_config.upscaling_factor",
                "engine_kwargs.enable_chunked_prefill=False",
                "engine_kwargs.disable_custom_all_reduce=False",
                "engine_kwargs.kv_cache_dtype='fp8'", "engine_kwargs.made_up_key",
                "also_made_up"):
        assert key in message, key
    assert "raylm always chunks long prompts" in message and "downloads nothing" in message


def test_ray_lora_config_turns_lora_on_with_adapters_by_name_from_its_path(tmp_path):
    cfg = LLMConfig.model_validate({
        "model_loading_config": {"model_id": "m", "model_source": "/models/m"},
        "lora_config": {"dynamic_lora_loading_path": str(tmp_path),
                        "max_num_adapters_per_replica": 4},
        "engine_kwargs": {"max_loras": 2}})
    ek = cfg.engine_kwargs
    assert (ek.enable_lora, ek.allowed_lora_root, ek.max_cpu_loras, ek.max_loras) == \
        (True, str(tmp_path), 4, 2)


def test_build_openai_app_args_ray_keys_are_refused():
    with pytest.raises(ValidationError, match="ingress_deployment_config: raylm sizes"):
        OpenAIAppConfig.model_validate({"llm_configs": [{"model_loading_config": {
            "model_id": "m"}}], "ingress_deployment_config": {"num_replicas": 2}})


@pytest.mark.parametrize("kwargs", [
    {"enable_chunked_prefill": True}, {"trust_remote_code": True}, {"trust_remote_code": False},
    {"hf_token": "x"}, {"tokenizer_mode": "auto"}, {"kv_cache_dtype": "auto"},
    {"quantization": None}, {"load_format": "safetensors"}, {"task": "generate"},
    {"guided_decoding_backend": "xgrammar"}, {"disable_log_stats": True},
    {"enable_auto_tool_choice": True, "tool_call_parser": "llama3_json"},
])
def test_vllm_arguments_raylm_already_honours_are_accepted(kwargs):
    args = EngineArgs.from_kwargs("/m", max_num_seqs=8, **kwargs)
    assert args.max_num_seqs == 8
    assert args.tool_call_parser == kwargs.get("tool_call_parser")
    cfg = LLMConfig.model_validate({"model_loading_config": {"model_id": "m"},
                                    "engine_kwargs": kwargs})
    assert not set(cfg.engine_kwargs.model_dump()) & (set(VLLM_ARGS) - {"tool_call_parser"})


@pytest.mark.parametrize("kwargs, reason", [
    ({"enable_chunked_prefill": False}, "always chunks long prompts"),
    ({"kv_cache_dtype": "fp8"}, "model's dtype"),
    ({"disable_custom_all_reduce": False}, "all-reduce is torch.distributed's"),
    ({"task": "embed"}, "text generation only"),
    ({"enable_auto_tool_choice": True}, "needs tool_call_parser"),
    ({"scheduling_policy": "priority"}, "first come, first served"),
])
def test_vllm_arguments_raylm_lacks_are_refused_with_the_reason(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        EngineArgs.from_kwargs("/m", **kwargs)
    with pytest.raises(ValidationError, match=reason):
        LLMConfig.model_validate({"model_loading_config": {"model_id": "m"},
                                  "engine_kwargs": kwargs})


def test_vllm_names_shared_with_raylm_reach_the_engine_config(llama_path):
    config = EngineArgs.from_kwargs(llama_path, max_num_batched_tokens=96,
                                    enable_prefix_caching=False, gpu_memory_utilization=0.5,
                                    enforce_eager=True, max_logprobs=7,
                                    enable_chunked_prefill=True).create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == 96
    assert not config.cache_config.enable_prefix_caching
    assert config.cache_config.gpu_memory_utilization == 0.5
    assert config.model_config.enforce_eager
    args = EngineArgs.from_kwargs(llama_path, max_logprobs=7)
    assert args.request_limits().max_logprobs == 7


def test_one_refusal_message_lists_refused_and_unknown_engine_arguments():
    with pytest.raises(ValueError) as e:
        EngineArgs.from_kwargs("/m", disable_custom_all_reduce=False, max_num_sequences=3)
    message = str(e.value)
    assert "disable_custom_all_reduce=False: raylm's all-reduce is torch.distributed's" in message
    assert "unknown engine argument(s) ['max_num_sequences']" in message
