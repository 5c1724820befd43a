"""A Ray Serve LLM ``LLMConfig`` read as raylm's: keys mapped to raylm's names, keys raylm
already honours dropped, and every key it does not implement named in one message (so a
config copied from Ray's docs loads after changing only ``import_path``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from raylm.cluster.engine.vllm_args import drop_accepted, unknown_keys, vllm_refusals

# Ray Serve LLM's LLMConfig keys (and those of its sections) that raylm has no field for,
# where it is the key's name that differs: value -> whether raylm already honours it, and
# what raylm does instead. Keys raylm shares with it (model_loading_config, engine_kwargs,
# deployment_config, accelerator_type, placement_group_config, runtime_env,
# experimental_configs.stream_batching_interval_ms) need no entry.
_RAY_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "llm_engine": (lambda v: v in ("vLLM", None),
                   "raylm is the engine; only Ray's default value 'vLLM' is accepted"),
    "log_engine_metrics": (lambda v: v in (True, None),
                           "raylm always exports its engine metrics on /metrics"),
    "accelerator_config": (lambda v: v is None,
                           "set accelerator_type and num_gpus_per_worker instead"),
    "server_cls": (lambda v: v is None, "raylm's replicas run its own LLMServer"),
    "callback_config": (lambda v: not v, "raylm has no initialization callbacks"),
}
_RAY_DEPLOYMENT_KEYS = {
    "name": "raylm names its deployments after model_id",
    "ray_actor_options": "raylm sizes the replica from placement_group_config (bundle 0)",
    "user_config": "raylm's LLMServer takes no user_config",
    "logging_config": "set Serve's logging in the Serve config's top-level logging_config",
    "request_router_config": "set deployment_config.request_router: pow2 or prefix "
                             "(raylm's prefix-cache-aware router)",
}
_RAY_AUTOSCALING_KEYS = ("metrics_interval_s", "upscaling_factor", "downscaling_factor",
                         "upscale_smoothing_factor", "downscale_smoothing_factor",
                         "smoothing_factor", "policy", "aggregation_function",
                         "downscale_to_zero_delay_s")
# Ray Serve LLM's lora_config keys -> raylm's engine arguments. Its download settings have
# no meaning here: adapters are folders read in place, nothing is downloaded.
_RAY_LORA_KEYS = {"dynamic_lora_loading_path": "allowed_lora_root",
                  "max_num_adapters_per_replica": "max_cpu_loras"}
_RAY_EXPERIMENTAL_KEYS = {"num_ingress_replicas": "raylm's ingress deployment autoscales "
                                                  "with the model's replicas"}


def migrate_ray_llm_config(data: Mapping[str, Any], llm_config_keys: Collection[str],
                           engine_kwargs_keys: Collection[str]
                           ) -> tuple[dict[str, Any], list[str], list[str]]:
    """A Ray Serve LLM LLMConfig dict as raylm's: (the dict with mapped keys moved and
    honoured ones dropped, one line per key raylm does not implement, dotted paths of keys
    nobody knows). Sections that are not mappings are left for validation to report."""
    out: dict[str, Any] = dict(data)
    refused: list[str] = []
    unknown: list[str] = []

    def section(name: str) -> dict[str, Any] | None:
        value = out.get(name)
        if isinstance(value, Mapping):
            out[name] = dict(value)
            return out[name]
        return None

    for key, (honoured, why) in _RAY_KEYS.items():
        if key in out:
            value = out.pop(key)
            if not honoured(value):
                refused.append(f"{key}={value!r}: {why}")
    lora = out.pop("lora_config", None)
    unknown += sorted(k for k in out if k not in llm_config_keys)
    if lora is not None:
        refused += _migrate_lora_config(lora, out)
    loading = section("model_loading_config")
    if loading is not None:
        if "tokenizer_source" in loading:  # Ray's name for the engine's tokenizer
            tokenizer = loading.pop("tokenizer_source")
            engine = section("engine_kwargs")
            if engine is None:
                out["engine_kwargs"] = engine = {}
            if tokenizer is not None:
                engine.setdefault("tokenizer", tokenizer)
        if isinstance(loading.get("model_source"), Mapping):
            refused.append("model_loading_config.model_source (a cloud bucket): raylm loads "
                           "a folder or GGUF file present on every node; copy the bucket there")
    engine = section("engine_kwargs")
    if engine is not None:
        known = engine_kwargs_keys
        refused += [f"engine_kwargs.{line}" for line in vllm_refusals(engine, known)]
        unknown += [f"engine_kwargs.{k}" for k in unknown_keys(engine, known)]
        out["engine_kwargs"] = drop_accepted(engine, known)
    deployment = section("deployment_config")
    if deployment is not None:
        for key, why in _RAY_DEPLOYMENT_KEYS.items():
            if key in deployment:
                refused.append(f"deployment_config.{key}: {why}")
        autoscaling = deployment.get("autoscaling_config")
        if isinstance(autoscaling, Mapping):
            refused += [f"deployment_config.autoscaling_config.{k}: raylm passes Serve "
                        "min/max/initial_replicas, target_ongoing_requests and the delays only"
                        for k in _RAY_AUTOSCALING_KEYS if k in autoscaling]
    pg = section("placement_group_config")
    if pg is not None and "bundle_per_worker" in pg:
        refused.append("placement_group_config.bundle_per_worker: give bundles (the "
                       "replica's, then one per pipeline stage holding its TP group)")
    experimental = section("experimental_configs")
    if experimental is not None:
        refused += [f"experimental_configs.{k}: {why}"
                    for k, why in _RAY_EXPERIMENTAL_KEYS.items() if k in experimental]
    return out, refused, unknown


def _migrate_lora_config(lora: Any, out: dict[str, Any]) -> list[str]:
    """Ray's ``lora_config`` into ``out``'s engine_kwargs: LoRA on, adapters loaded by name
    from ``dynamic_lora_loading_path`` as requests name them (``base:adapter``), at most
    ``max_num_adapters_per_replica`` kept per replica. Returns the refusals."""
    if not isinstance(lora, Mapping):
        return [f"lora_config={lora!r}: a mapping of {sorted(_RAY_LORA_KEYS)}"]
    refused = [f"lora_config.{k}: raylm reads adapters in place from "
               "dynamic_lora_loading_path (a folder on every node); it downloads nothing"
               for k in lora if k not in _RAY_LORA_KEYS]
    engine = out.get("engine_kwargs")
    engine = dict(engine) if isinstance(engine, Mapping) else {}
    engine.setdefault("enable_lora", True)
    for key, ours in _RAY_LORA_KEYS.items():
        if lora.get(key) is not None:
            engine.setdefault(ours, lora[key])
    out["engine_kwargs"] = engine
    return refused
