"""The serving-facing config, shaped like Ray Serve LLM's ``LLMConfig``: pydantic, because it
crosses YAML, Helm and HTTP; every model forbids unknown keys, so a typo fails with its
dotted path. ``raylm.cluster:build_openai_app`` receives ``{"llm_configs": [<LLMConfig>,
...]}`` from ``serve run`` and KubeRay alike (docs/serving.md; a full file in
cluster/serve/example_config.yaml).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import (
    BaseModel,
    Field,
    NonNegativeFloat,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from raylm.cluster.engine.engine_args import (
    EngineArgs,
    PoolingTypeName,
    ReasoningParserName,
    ToolCallParserName,
    engine_arg_fields,
    engine_arg_types,
)
from raylm.cluster.engine.vllm_args import drop_accepted, vllm_refusals
from raylm.cluster.serve.deployment.deployment_config import (
    STRICT,
    AutoscalingConfig,
    DeploymentConfig,
    ExperimentalConfigs,
    HTTPServerConfig,
    PlacementGroupConfig,
)
from raylm.cluster.serve.deployment.ray_llm_migration import migrate_ray_llm_config
from raylm.scheduler.config.engine_config import ExecutorBackend, dp_rank_bundles, stage_bundles

__all__ = [
    "AutoscalingConfig",
    "DeploymentConfig",
    "EngineKwargs",
    "ExperimentalConfigs",
    "HTTPServerConfig",
    "LLMConfig",
    "ModelLoadingConfig",
    "OpenAIAppConfig",
    "PlacementGroupConfig",
    "load_app_config",
]

BUILD_OPENAI_APP = "raylm.cluster:build_openai_app"


def _read_yaml(path: str | os.PathLike[str]) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


class ModelLoadingConfig(BaseModel):
    model_config = STRICT

    model_id: str = Field(min_length=1, description="The name clients send as `model`.")
    # A local Hugging Face folder (config.json + safetensors + tokenizer) or GGUF file on
    # every node; "demo" / "demo-random": the small random-weight demo model raylm writes
    # itself; None: the default model (SmolLM2-135M-Instruct), fetched by each node.
    model_source: str | None = Field(default=None, min_length=1)

    @property
    def is_demo(self) -> bool:
        from raylm.cluster.demo import DEMO_MODEL_NAMES

        return self.model_source in DEMO_MODEL_NAMES

    @property
    def is_default(self) -> bool:
        return self.model_source is None

    def node_resolver(self) -> Callable[[], str] | None:
        """What each node that loads the model calls to find its own copy (in its own
        cache): the default model is fetched, the demo model written, by every node for
        itself; a folder must be present on every node."""
        if self.is_default:
            from raylm.runner.loading.default_model import resolve_default_model

            return resolve_default_model
        if not self.is_demo:
            return None
        from raylm.cluster.demo import ensure_demo_model

        return ensure_demo_model

    def resolve_model_source(self) -> str:
        """The checkpoint to load on this node; fetches the default model or writes the demo
        model on first use."""
        # Imported here: these pull in the checkpoint code, config loading must not.
        if self.is_default:
            from raylm.runner.loading.default_model import resolve_default_model

            return resolve_default_model()
        if self.is_demo:
            from raylm.cluster.demo import ensure_demo_model

            return ensure_demo_model()
        assert self.model_source is not None
        return self.model_source


# Engine arguments that an LLMConfig holds in a section of its own, as Ray Serve LLM's
# LLMConfig does; every other EngineArgs field is a key of ``engine_kwargs``.
ENGINE_ARGS_ELSEWHERE = {
    "model": "model_loading_config.model_source",
    "served_model_name": "model_loading_config.model_id",
    "placement_group_strategy": "placement_group_config.strategy",
}


class _EngineKwargsBase(BaseModel):
    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data: Any) -> Any:
        """vLLM's arguments raylm has no field for: dropped where raylm already behaves as
        they ask, refused (all named at once) otherwise (cluster/engine/vllm_args.py)."""
        if not isinstance(data, Mapping):
            return data
        refused = vllm_refusals(data, cls.model_fields)
        if refused:
            raise ValueError("refused engine argument(s): " + "; ".join(refused))
        return drop_accepted(data, cls.model_fields)

    @field_validator("*")
    @classmethod
    def _check_in_engine_config(cls, value: Any, info: ValidationInfo) -> Any:
        # The frozen engine configs are the one place values are checked; each value is
        # checked among defaults, so that the error carries its field's name.
        assert info.field_name is not None
        EngineArgs(model="", **{info.field_name: value}).check_without_checkpoint()
        return value

    @model_validator(mode="after")
    def _check_together(self) -> _EngineKwargsBase:
        EngineArgs(model="", **self.to_llm_kwargs()).check_without_checkpoint()
        return self

    @property
    def world_size(self) -> int:
        """Workers of one engine (one DP rank): TP x PP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size  # type: ignore[attr-defined]

    def to_llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``raylm.LLM(model, **kwargs)`` / ``EngineArgs``."""
        return self.model_dump()


def _engine_kwargs_model() -> type[_EngineKwargsBase]:
    types = engine_arg_types()
    # The bounds go into the JSON schema only (the Helm chart's is generated from it):
    # the values themselves are checked by the engine configs, as every other one is.
    return create_model(  # type: ignore[call-overload, no-any-return]
        "EngineKwargs", __base__=_EngineKwargsBase, __module__=__name__,
        __doc__="Engine arguments (``raylm.cluster.engine.engine_args.EngineArgs``, whose fields "
                "this model is generated from, with their defaults, help and bounds).",
        **{f.name: (types[f.name], Field(default=f.default, description=f.metadata["help"],
                                         json_schema_extra=f.metadata.get("bounds")))
           for f in engine_arg_fields(exclude=ENGINE_ARGS_ELSEWHERE)})


if TYPE_CHECKING:
    class EngineKwargs(_EngineKwargsBase):
        """mypy's view of the generated model (it cannot see create_model's fields): the
        fields raylm reads, typed as in EngineArgs. Add one here before reading it."""

        tokenizer: str | None
        max_num_seqs: int
        block_size: int
        enable_prefix_caching: bool
        tensor_parallel_size: int
        pipeline_parallel_size: int
        data_parallel_size: int
        distributed_executor_backend: ExecutorBackend | None
        max_queued_requests: int | None
        tool_call_parser: ToolCallParserName | None
        reasoning_parser: ReasoningParserName | None
        pooling_type: PoolingTypeName
        enable_lora: bool
        max_loras: int
        max_cpu_loras: int | None
        lora_modules: list[str] | None
        allowed_lora_root: str | None

        def __init__(self, **data: Any) -> None: ...  # every field has a default
else:
    EngineKwargs = _engine_kwargs_model()


class LLMConfig(BaseModel):
    """One model served by the OpenAI app: what to load, how to run it, how to scale it."""

    model_config = STRICT

    model_loading_config: ModelLoadingConfig
    engine_kwargs: EngineKwargs = Field(default_factory=EngineKwargs)
    deployment_config: DeploymentConfig = Field(default_factory=DeploymentConfig)
    placement_group_config: PlacementGroupConfig | None = None
    # e.g. "H100": pins the GPU workers to nodes of that type (Ray's `accelerator_type:<T>`).
    accelerator_type: str | None = Field(default=None, min_length=1)
    # GPUs each TP x PP worker reserves; None: 1 when accelerator_type is set or the
    # cluster has GPUs when the app is built (with_default_devices), else 0 (CPU).
    num_gpus_per_worker: NonNegativeFloat | None = None
    api_key: str | None = Field(default=None, min_length=1)
    runtime_env: dict[str, Any] | None = None
    experimental_configs: ExperimentalConfigs = Field(default_factory=ExperimentalConfigs)

    @model_validator(mode="before")
    @classmethod
    def _from_ray_serve_llm(cls, data: Any) -> Any:
        """A config written for Ray Serve LLM: its keys that raylm implements differently
        are mapped, those whose value raylm already honours dropped, and every one that
        raylm does not implement named in one error (with any unknown key beside)."""
        if not isinstance(data, Mapping):
            return data
        migrated, refused, unknown = migrate_ray_llm_config(data, cls.model_fields,
                                                            EngineKwargs.model_fields)
        if refused:
            message = ("keys of Ray Serve LLM's LLMConfig that raylm does not implement: "
                       + "; ".join(refused))
            if unknown:
                message += f". Unknown keys: {unknown}"
            raise ValueError(message + ".")
        return migrated

    @model_validator(mode="after")
    def _check_consistency(self) -> LLMConfig:
        if self.accelerator_type is not None and self.num_gpus_per_worker == 0:
            raise ValueError(
                f"accelerator_type={self.accelerator_type!r} requests GPUs but "
                "num_gpus_per_worker=0; drop one of them.")
        gpus = self.num_gpus_per_worker
        if gpus is not None and gpus != int(gpus):
            # Ray would pack two ranks onto one device, each sizing its KV cache for all of it.
            raise ValueError(f"num_gpus_per_worker must be a whole number (each rank owns its "
                             f"GPU), got {gpus:g}.")
        pg = self.placement_group_config
        need = len(self.default_placement_group().bundles)
        if pg is not None and len(pg.bundles) < need:
            ek = self.engine_kwargs
            per_rank = ("one per pipeline stage, holding its tensor_parallel_size workers"
                        if ek.data_parallel_size == 1 else
                        "per DP rank one per pipeline stage (holding its "
                        "tensor_parallel_size workers), plus one for its EngineCore when "
                        "tensor_parallel_size x pipeline_parallel_size > 1")
            raise ValueError(
                f"placement_group_config.bundles has {len(pg.bundles)} bundles but "
                f"pipeline_parallel_size={ek.pipeline_parallel_size} x "
                f"data_parallel_size={ek.data_parallel_size} need {need} (one for the "
                f"replica, {per_rank}).")
        if pg is not None:
            for i, (have, want) in enumerate(zip(pg.bundles, self.default_placement_group().bundles,
                                                 strict=False)):
                if have.get("GPU", 0.0) < want.get("GPU", 0.0):
                    raise ValueError(
                        f"placement_group_config.bundles[{i}]={have} holds fewer GPUs than "
                        f"the {want.get('GPU', 0.0):g} its ranks need: each pipeline stage's "
                        "bundle holds its whole tensor-parallel group (a bundle is one node), "
                        f"e.g. {want}.")
        return self

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    @property
    def use_gpu(self) -> bool:
        return self.accelerator_type is not None or (self.num_gpus_per_worker or 0) > 0

    @property
    def gpus_per_worker(self) -> float:
        if self.num_gpus_per_worker is not None:
            return self.num_gpus_per_worker
        return 1.0 if self.use_gpu else 0.0

    def default_placement_group(self) -> PlacementGroupConfig:
        """One ``{"CPU": 1}`` bundle for the replica, co-located with rank 0, then one bundle
        per pipeline stage holding its TP group's workers (each GPUs when GPU use is
        requested, else one CPU), so a TP group never spans nodes. With
        data_parallel_size = d > 1, d rank slices follow the replica's bundle (the DP client
        places its rank actors in them rather than reserving groups of its own)."""
        if self.use_gpu:
            worker: dict[str, float] = {"GPU": self.gpus_per_worker}
            if self.accelerator_type is not None:
                # A token amount of Ray's per-node accelerator resource pins the node type.
                worker[f"accelerator_type:{self.accelerator_type}"] = 0.001
        else:
            worker = {"CPU": 1.0}
        ek = self.engine_kwargs
        tp, pp = ek.tensor_parallel_size, ek.pipeline_parallel_size
        if ek.data_parallel_size == 1:
            ranks = stage_bundles(tp, pp, worker)
        else:
            ranks = [b for _ in range(ek.data_parallel_size)
                     for b in dp_rank_bundles(tp, pp, {"CPU": 1.0}, worker)]
        return PlacementGroupConfig(bundles=[{"CPU": 1.0}] + ranks, strategy="PACK")

    def with_default_devices(self, cluster_gpus: float) -> LLMConfig:
        """The config a cluster with ``cluster_gpus`` GPUs serves: with neither
        accelerator_type nor num_gpus_per_worker set, every rank takes one GPU when the
        cluster has any (as vLLM and Ray Serve LLM do); num_gpus_per_worker=0 keeps CPU."""
        if (self.num_gpus_per_worker is not None or self.accelerator_type is not None
                or cluster_gpus <= 0):
            return self
        return LLMConfig.model_validate({**self.model_dump(exclude_unset=True),
                                         "num_gpus_per_worker": 1})

    def get_placement_group(self) -> PlacementGroupConfig:
        """The explicit placement_group_config, else the default one."""
        return self.placement_group_config or self.default_placement_group()

    def engine_args(self) -> EngineArgs:
        """What a replica builds its engine from (on its own node: fetches the default model
        or writes the demo model on first use)."""
        return EngineArgs(
            model=self.model_loading_config.resolve_model_source(),
            served_model_name=self.model_id,
            placement_group_strategy=self.get_placement_group().strategy,
            **self.engine_kwargs.to_llm_kwargs())

    @classmethod
    def from_engine_kwargs(cls, kwargs: Mapping[str, Any], *, model_id: str,
                           model_source: str | None, **fields: Any) -> LLMConfig:
        """An LLMConfig from flat engine arguments (the CLI's), each put where LLMConfig
        keeps it (ENGINE_ARGS_ELSEWHERE)."""
        engine_kwargs = {k: v for k, v in kwargs.items() if k not in ENGINE_ARGS_ELSEWHERE}
        config = cls.model_validate({
            "model_loading_config": {"model_id": model_id, "model_source": model_source},
            "engine_kwargs": engine_kwargs, **fields})
        strategy = kwargs.get("placement_group_strategy")
        if strategy is None:
            return config
        bundles = config.default_placement_group().bundles
        return cls.model_validate({
            **config.model_dump(exclude_unset=True),
            "placement_group_config": {"bundles": bundles, "strategy": strategy}})

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> LLMConfig:
        data = _read_yaml(path)
        if not isinstance(data, Mapping):
            raise ValueError(f"{os.fspath(path)!r} must hold one LLMConfig mapping, "
                             f"got {type(data).__name__}.")
        return cls.model_validate(data)




# Ray Serve LLM's build_openai_app args (LLMServingArgs) that raylm does not implement.
_RAY_APP_KEYS = {
    "ingress_deployment_config": "raylm sizes its ingress deployment from the models' "
                                 "replicas",
    "ingress_cls_config": "raylm's ingress is its own OpenAIIngress",
}


class OpenAIAppConfig(BaseModel):
    """The args of ``build_openai_app``: the models one OpenAI endpoint serves."""

    model_config = STRICT

    llm_configs: list[LLMConfig] = Field(min_length=1)
    http_server: HTTPServerConfig = Field(default_factory=HTTPServerConfig)
    # One model only: its LLMServer replicas answer HTTP themselves, with no ingress
    # deployment. Each streamed chunk then crosses one Python process fewer
    # (docs/performance.md has the cost), but a replica that dies mid-stream cuts its streams: no
    # process is left to end them with an error event, as the ingress does.
    ingress_in_replica: bool = False

    @model_validator(mode="before")
    @classmethod
    def _ray_app_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            refused = [f"{k}: {why}" for k, why in _RAY_APP_KEYS.items()
                       if data.get(k) not in (None, {})]
            if refused:
                raise ValueError("keys of Ray Serve LLM's build_openai_app args that raylm "
                                 "does not implement: " + "; ".join(refused) + ".")
            data = {k: v for k, v in data.items() if k not in _RAY_APP_KEYS}
        return data

    @field_validator("llm_configs", mode="before")
    @classmethod
    def _load_yaml_items(cls, items: Any) -> Any:
        if isinstance(items, list):
            return [LLMConfig.from_yaml(x) if isinstance(x, str | os.PathLike) else x
                    for x in items]
        return items

    @model_validator(mode="after")
    def _unique_model_ids(self) -> OpenAIAppConfig:
        if self.ingress_in_replica and len(self.llm_configs) != 1:
            raise ValueError(f"ingress_in_replica needs exactly one model in llm_configs, "
                             f"got {len(self.llm_configs)}: the ingress routes between models.")
        if self.ingress_in_replica:
            (config,) = self.llm_configs
            dc = config.deployment_config
            most = dc.num_replicas if dc.num_replicas is not None else \
                dc.autoscaling_config.max_replicas
            if dc.request_router.policy == "prefix" and most > 1:
                raise ValueError(
                    "deployment_config.request_router 'prefix' reads each request's prompt "
                    "in the ingress deployment's router, and with ingress_in_replica there is "
                    f"none in front of the {most} replicas; set ingress_in_replica false (or "
                    "serve one replica).")
        ids = [c.model_id for c in self.llm_configs]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"llm_configs: model_id {dup} appears more than once; "
                             "each served model needs its own model_id.")
        return self


AppConfigLike = OpenAIAppConfig | LLMConfig | Mapping[str, Any] | str | os.PathLike[str]


def load_app_config(config: AppConfigLike) -> OpenAIAppConfig:
    """Build the app config from what ``build_openai_app`` or a user hands over:
    an OpenAIAppConfig, one LLMConfig, the args dict ``{"llm_configs": [...]}``, one
    LLMConfig dict, a whole Serve config dict (``applications: [...]``; the raylm app's
    args are used), or the path of a YAML file holding any of those dicts."""
    if isinstance(config, OpenAIAppConfig):
        return config
    if isinstance(config, LLMConfig):
        return OpenAIAppConfig(llm_configs=[config])
    if isinstance(config, str | os.PathLike):
        data = _read_yaml(config)
        if not isinstance(data, Mapping):
            raise ValueError(f"{os.fspath(config)!r} must hold a mapping, "
                             f"got {type(data).__name__}.")
        config = data
    if not isinstance(config, Mapping):
        raise ValueError(f"app config must be a mapping or a YAML path, got {config!r}.")
    if "applications" in config:
        config = _raylm_app_args(config["applications"])
    if "llm_configs" in config:
        return OpenAIAppConfig.model_validate(dict(config))
    if "model_loading_config" in config:
        return OpenAIAppConfig(llm_configs=[LLMConfig.model_validate(dict(config))])
    raise ValueError(f"app config needs 'llm_configs' (or one LLMConfig with "
                     f"'model_loading_config'); got keys {sorted(config)}.")


def _raylm_app_args(applications: Any) -> Mapping[str, Any]:
    apps = [a for a in applications or [] if isinstance(a, Mapping)]
    ours = [a for a in apps if a.get("import_path") == BUILD_OPENAI_APP]
    if len(ours) != 1:
        raise ValueError(f"Serve config must have exactly one application with import_path "
                         f"{BUILD_OPENAI_APP!r}; found {len(ours)} among "
                         f"{[a.get('name') for a in apps]}.")
    args = ours[0].get("args") or {}
    if not isinstance(args, Mapping):
        raise ValueError(f"application {ours[0].get('name')!r} args must be a mapping, "
                         f"got {args!r}.")
    return args

