"""Ray Serve's side of a served model: replicas and autoscaling, the placement group's bundles,
the HTTP server's settings, Ray Serve LLM's experimental_configs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from raylm.scheduler.config.engine_config import PlacementStrategy

# Every config model forbids unknown keys: a typo fails with its dotted path.
STRICT = ConfigDict(extra="forbid", frozen=True)

# Ray Serve's custom autoscaling policy for "engine_signals" (cluster/serve/deployment/autoscaling_policy.py).
ENGINE_SIGNAL_POLICY = "raylm.cluster.serve.deployment.autoscaling_policy:EngineSignalPolicy"
# raylm's keys of autoscaling_config that go to that policy, not to Serve.
_POLICY_KEYS = ("scale_on", "target_num_requests_waiting", "target_kv_cache_usage")

class AutoscalingConfig(BaseModel):
    """Ray Serve replica autoscaling (a subset of ``ray.serve.config.AutoscalingConfig``)."""

    model_config = STRICT

    min_replicas: NonNegativeInt = Field(default=1,
                                         description="Fewest replicas (0: scale to zero).")
    max_replicas: PositiveInt = Field(default=1, description="Most replicas.")
    # An LLM replica batches many requests, so the target is far above Serve's default 2.
    target_ongoing_requests: PositiveFloat = Field(
        default=16, description="Ongoing requests per replica the autoscaler aims for.")
    initial_replicas: NonNegativeInt | None = Field(
        default=None, description="Replicas at deploy time (default: min_replicas).")
    upscale_delay_s: NonNegativeFloat | None = Field(
        default=None,
        description="How long demand must stay high before a replica is added.")
    downscale_delay_s: NonNegativeFloat | None = Field(
        default=None,
        description="How long demand must stay low before a replica is removed.")
    look_back_period_s: PositiveFloat | None = Field(
        default=None,
        description="The window Serve averages ongoing requests over (Serve: 30 s).")
    scale_on: Literal["ongoing_requests", "engine_signals"] = Field(
        default="ongoing_requests", description=(
            "ongoing_requests: Serve's default policy (target_ongoing_requests). "
            "engine_signals: also the engines' waiting requests and KV usage."))
    target_num_requests_waiting: PositiveFloat = Field(
        default=4.0, description="engine_signals: requests waiting in each replica's engine "
                                 "above which replicas are added, in proportion.")
    target_kv_cache_usage: float = Field(
        default=0.9, gt=0, le=1,
        description="engine_signals: KV usage (0-1) a replica aims for.")

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

    def to_serve_options(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config``: raylm's policy keys become Serve's ``policy``."""
        opts = self.model_dump(exclude_none=True, exclude=set(_POLICY_KEYS))
        if self.scale_on == "engine_signals":
            opts["policy"] = {"policy_function": ENGINE_SIGNAL_POLICY, "policy_kwargs": {
                "target_num_requests_waiting": self.target_num_requests_waiting,
                "target_kv_cache_usage": self.target_kv_cache_usage}}
        return opts


class RequestRouterConfig(BaseModel):
    """How the model's replicas share requests (cluster/serve/deployment/router.py): ``pow2``, Ray
    Serve's power of two choices, or ``prefix``, prefix-cache affinity with load first. A
    string is the policy alone (``request_router: prefix``)."""

    model_config = STRICT

    policy: Literal["pow2", "prefix"] = "pow2"
    imbalance_threshold: NonNegativeFloat = Field(
        default=8.0, description="prefix: when the replicas' ongoing requests differ by more, "
                                 "the least loaded one wins, whatever it holds.")
    min_match_ratio: float = Field(
        default=0.1, ge=0, le=1, description="prefix: the least share of a prompt's KV blocks "
                                             "a replica must hold to be chosen for it.")
    entry_ttl_s: PositiveFloat = Field(
        default=600.0, description="prefix: a prompt block the router saw go to a replica "
                                   "counts as cached there for this long after its last use.")
    stats_period_s: PositiveFloat = Field(
        default=1.0, description="How often each replica reports its KV usage and counters to "
                                 "the routers (Serve's request_routing_stats_period_s).")

    @model_validator(mode="before")
    @classmethod
    def _policy_alone(cls, data: Any) -> Any:
        return {"policy": data} if isinstance(data, str) else data


class DeploymentConfig(BaseModel):
    """Ray Serve deployment options of the LLM server."""

    model_config = STRICT

    autoscaling_config: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    # Requests one replica accepts at once; beyond it the router queues or picks another.
    max_ongoing_requests: PositiveInt = 64
    # A fixed replica count instead of autoscaling.
    num_replicas: NonNegativeInt | None = None
    # How long a replica being scaled down waits for in-flight generations (Serve: 20 s).
    graceful_shutdown_timeout_s: NonNegativeFloat | None = None
    # Serve's own deployment options, passed on as they are (None: Serve's defaults).
    graceful_shutdown_wait_loop_s: NonNegativeFloat | None = None
    health_check_period_s: PositiveFloat | None = None
    health_check_timeout_s: PositiveFloat | None = None
    # Requests Serve's router queues for the deployment beyond max_ongoing_requests per
    # replica before it answers 503 (-1: no limit).
    max_queued_requests: int | None = Field(default=None, ge=-1)
    request_router: RequestRouterConfig = Field(default_factory=RequestRouterConfig)

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
            opts["autoscaling_config"] = self.autoscaling_config.to_serve_options()
        for key in ("graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s",
                    "health_check_period_s", "health_check_timeout_s", "max_queued_requests"):
            if getattr(self, key) is not None:
                opts[key] = getattr(self, key)
        return opts


class PlacementGroupConfig(BaseModel):
    """Bundles of one replica: bundle 0 holds the replica (and rank 0's driver side),
    bundles 1.. hold the TP x PP worker actors, in rank order."""

    model_config = STRICT

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

    model_config = STRICT

    # A request's streamed chunks that the replica produces within this window of the
    # first cross the Serve handle (and the HTTP proxy) as one item; the first token is
    # never delayed. Every item costs CPU in the replica, the ingress and the proxy: the
    # window must span several decode steps to save any (bench/serve.py; figures in
    # docs/performance.md). Same key, meaning and default as Ray Serve LLM; 0 sends each chunk on its own.
    stream_batching_interval_ms: NonNegativeFloat = 50.0


class HTTPServerConfig(BaseModel):
    """The HTTP side of the OpenAI endpoint, for every model it serves (``raylm serve``'s
    flags of the same names)."""

    model_config = STRICT

    # CORS, as vLLM's flags: off (no CORS headers at all) while allowed_origins is empty.
    allowed_origins: list[str] = Field(default_factory=list, description=(
        "Origins a browser may call the API from ('*' for any); empty: CORS off."))
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # A body larger than this is refused with 413 before it is read whole.
    max_request_body_bytes: PositiveInt = 16 * 1024 * 1024
    # JSON nested deeper than this (arrays and objects) is refused with 400.
    max_json_depth: PositiveInt = 64
    # With an api_key set, /metrics still answers without one (for a scraper inside the
    # cluster); every other route but /health needs the key.
    public_metrics: bool = False

    @model_validator(mode="after")
    def _check_cors(self) -> HTTPServerConfig:
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials needs explicit allowed_origins: a browser "
                             "refuses credentials for the '*' origin.")
        return self

