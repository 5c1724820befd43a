"""The serving-facing config, shaped like Ray Serve LLM's ``LLMConfig``: pydantic, because it
crosses YAML, Helm and HTTP; every model forbids unknown keys, so a typo fails with its
dotted path. ``raylm.cluster:build_openai_app`` receives ``{"llm_configs": [<LLMConfig>,
...]}`` from ``serve run`` and KubeRay alike (docs/serving.md; a full file in
cluster/serve/example_config.yaml).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from raylm.cluster.engine.engine_args import EngineArgs, engine_arg_fields, engine_arg_types
from raylm.scheduler.config.engine_config import PlacementStrategy, dp_rank_bundles, stage_bundles

__all__ = [
    "AutoscalingConfig",
    "DeploymentConfig",
    "EngineKwargs",
    "ExperimentalConfigs",
    "LLMConfig",
    "ModelLoadingConfig",
    "OpenAIAppConfig",
    "PlacementGroupConfig",
    "load_app_config",
]

BUILD_OPENAI_APP = "raylm.cluster:build_openai_app"
_STRICT = ConfigDict(extra="forbid", frozen=True)


def _read_yaml(path: str | os.PathLike[str]) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


class ModelLoadingConfig(BaseModel):
    model_config = _STRICT

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
    model_config = _STRICT

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


EngineKwargs = _engine_kwargs_model()


class AutoscalingConfig(BaseModel):
    """Ray Serve replica autoscaling (a subset of ``ray.serve.config.AutoscalingConfig``)."""

    model_config = _STRICT

    min_replicas: NonNegativeInt = Field(1, description="Fewest replicas (0: scale to zero).")
    max_replicas: PositiveInt = Field(1, description="Most replicas.")
    # An LLM replica batches many requests, so the target is far above Serve's default 2.
    target_ongoing_requests: PositiveFloat = Field(
        16, description="Ongoing requests per replica the autoscaler aims for.")
    initial_replicas: NonNegativeInt | None = Field(
        None, description="Replicas at deploy time (default: min_replicas).")
    upscale_delay_s: NonNegativeFloat | None = Field(
        None, description="How long demand must stay high before a replica is added.")
    downscale_delay_s: NonNegativeFloat | None = Field(
        None, description="How long demand must stay low before a replica is removed.")
    look_back_period_s: PositiveFloat | None = Field(
        None, description="The window Serve averages ongoing requests over (Serve: 30 s).")

    @model_validator(mode="after")
    def _check_range(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} must not exceed "
                             f"max_replicas={self.max_replicas}.")
        init = self.initial_replicas
        if init is not None and not self.min_replicas <= init <= self.max_replicas:
            raise ValueError(f"initial_replicas={init} must lie in [min_replicas="
                             f"{self.min_replicas}, max_replicas={self.max_replicas}].")
        return self


class DeploymentConfig(BaseModel):
    """Ray Serve deployment options of the LLM server."""

    model_config = _STRICT

    autoscaling_config: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    # Requests one replica accepts at once; beyond it the router queues or picks another.
    max_ongoing_requests: PositiveInt = 64
    # A fixed replica count instead of autoscaling.
    num_replicas: NonNegativeInt | None = None
    # How long a replica being scaled down waits for in-flight generations (Serve: 20 s).
    graceful_shutdown_timeout_s: NonNegativeFloat | None = None

    @model_validator(mode="after")
    def _check(self) -> DeploymentConfig:
        if self.num_replicas is not None and "autoscaling_config" in self.model_fields_set:
            raise ValueError(f"num_replicas={self.num_replicas} and autoscaling_config are "
                             "exclusive; set one of them.")
        target = self.autoscaling_config.target_ongoing_requests
        if self.num_replicas is None and target > self.max_ongoing_requests:
            raise ValueError(
                f"autoscaling_config.target_ongoing_requests={target} exceeds "
                f"max_ongoing_requests={self.max_ongoing_requests}; a replica can never "
                "reach its target, so autoscaling would not work.")
        return self

    def to_serve_options(self) -> dict[str, Any]:
        """Keyword arguments for ``serve.deployment(...)`` / ``Deployment.options(...)``."""
        opts: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests}
        if self.num_replicas is not None:
            opts["num_replicas"] = self.num_replicas
        else:
            opts["autoscaling_config"] = self.autoscaling_config.model_dump(exclude_none=True)
        if self.graceful_shutdown_timeout_s is not None:
            opts["graceful_shutdown_timeout_s"] = self.graceful_shutdown_timeout_s
        return opts


class PlacementGroupConfig(BaseModel):
    """Bundles of one replica: bundle 0 holds the replica (and rank 0's driver side),
    bundles 1.. hold the TP x PP worker actors, in rank order."""

    model_config = _STRICT

    bundles: list[dict[str, NonNegativeFloat]] = Field(min_length=1)
    strategy: PlacementStrategy = "PACK"

    @field_validator("bundles")
    @classmethod
    def _bundles_reserve_something(cls, bundles: list[dict[str, float]]) -> list[dict[str, float]]:
        for i, bundle in enumerate(bundles):
            # Ray rejects a bundle that reserves nothing; say which one before Ray does.
            if not any(v > 0 for v in bundle.values()):
                raise ValueError(f"bundles[{i}]={bundle!r} reserves no resource; "
                                 "give at least one resource a positive amount.")
            if any(not k for k in bundle):
                raise ValueError(f"bundles[{i}]={bundle!r} has an empty resource name.")
        return bundles


class ExperimentalConfigs(BaseModel):
    """Ray Serve LLM's ``experimental_configs``: the keys raylm reads (others are refused,
    as everywhere in this config)."""

    model_config = _STRICT

    # A request's streamed chunks that the replica produces within this window of the
    # first cross the Serve handle (and the HTTP proxy) as one item; the first token is
    # never delayed. Every item costs CPU in the replica, the ingress and the proxy: the
    # window must span several decode steps to save any (bench/serve.py; figures in
    # docs/performance.md). Same key, meaning and default as Ray Serve LLM; 0 sends each chunk on its own.
    stream_batching_interval_ms: NonNegativeFloat = 50.0


class LLMConfig(BaseModel):
    """One model served by the OpenAI app: what to load, how to run it, how to scale it."""

    model_config = _STRICT

    model_loading_config: ModelLoadingConfig
    engine_kwargs: EngineKwargs = Field(default_factory=EngineKwargs)  # type: ignore[valid-type]
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


class OpenAIAppConfig(BaseModel):
    """The args of ``build_openai_app``: the models one OpenAI endpoint serves."""

    model_config = _STRICT

    llm_configs: list[LLMConfig] = Field(min_length=1)
    # One model only: its LLMServer replicas answer HTTP themselves, with no ingress
    # deployment. Each streamed chunk then crosses one Python process fewer
    # (docs/performance.md has the cost), but a replica that dies mid-stream cuts its streams: no
    # process is left to end them with an error event, as the ingress does.
    ingress_in_replica: bool = False

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

