"""The Ray Serve OpenAI app: one ``LLMServer`` deployment per model behind an HTTP ingress,
which routes by ``model`` and ends a dead replica's streams with an error event. With
``ingress_in_replica`` (one model; `raylm serve` sets it) the replica answers HTTP itself:
one process fewer per streamed chunk (docs/architecture.md §2). The ingress's handle picks
a model's replica with the deployment's request router (cluster/serve/deployment/router.py, §14).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from raylm.actors.actor_logging import show_raylm_info_logs
from raylm.cluster.engine.engine_protocol import EngineClient, KVPoolSized
from raylm.cluster.serve.deployment.autoscaling_policy import autoscaling_stats
from raylm.cluster.serve.deployment.config import LLMConfig, OpenAIAppConfig, load_app_config
from raylm.cluster.serve.deployment.deployment_config import HTTPServerConfig
from raylm.cluster.serve.deployment.metrics import routing_stats
from raylm.cluster.serve.deployment.router_stats import find_router_view, with_router_view
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.routes import ModelBackend, build_openai_api, serve_stream

if TYPE_CHECKING:
    from ray.serve.deployment import Deployment

logger = logging.getLogger(__name__)

EngineFactory = Callable[[LLMConfig], EngineClient]
# The ingress only relays bytes; it must never be the reason a request waits.
INGRESS_MAX_ONGOING_REQUESTS = 4096


def default_engine_factory(llm_config: LLMConfig) -> EngineClient:
    from raylm.cluster.engine.async_llm import AsyncLLM

    return AsyncLLM.from_llm_config(llm_config)


def max_pending_requests(llm_config: LLMConfig) -> int | None:
    """Requests a replica admits before answering 503: the running batch plus the queue."""
    kwargs = llm_config.engine_kwargs
    if kwargs.max_queued_requests is None:
        return None
    return (kwargs.max_num_seqs + kwargs.max_queued_requests) * kwargs.data_parallel_size


async def coalesce(items: AsyncGenerator[Any, None], interval_s: float
                   ) -> AsyncGenerator[Any, None]:
    """Pass the first item on at once, then join the SSE lines that arrive within
    ``interval_s`` of each other's first into one item: every item crossing a Serve handle
    and the HTTP proxy costs CPU, and many small ones cap the tokens per second."""
    it = items  # an async generator is its own iterator (aiter(items) is items)
    try:
        first = await anext(it)
    except StopAsyncIteration:
        return
    yield first
    if not isinstance(first, str) or interval_s <= 0:
        async for item in it:
            yield item
        return
    loop = asyncio.get_running_loop()
    nxt: asyncio.Future | None = asyncio.ensure_future(anext(it))
    try:
        while nxt is not None:
            try:
                batch = [await nxt]
            except StopAsyncIteration:
                return
            deadline = loop.time() + interval_s
            nxt = asyncio.ensure_future(anext(it))
            while (left := deadline - loop.time()) > 0:
                done, _ = await asyncio.wait({nxt}, timeout=left)
                if not done:
                    break
                try:
                    batch.append(nxt.result())
                except StopAsyncIteration:
                    nxt = None
                    break
                nxt = asyncio.ensure_future(anext(it))
            yield "".join(batch)
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
        await it.aclose()


def _show_startup_logs_in_replica() -> None:
    """In a Serve replica, raylm's INFO lines go to the replica's stderr (actor_logging)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:  # not in a Serve replica (tests, the offline API)
        return
    show_raylm_info_logs()


class LLMServer:
    """One replica serving one model."""

    def __init__(self, llm_config: LLMConfig | dict[str, Any],
                 engine_factory: EngineFactory | None = None):
        _show_startup_logs_in_replica()
        self.llm_config = (llm_config if isinstance(llm_config, LLMConfig)
                           else LLMConfig.model_validate(llm_config))
        self.engine = (engine_factory or default_engine_factory)(self.llm_config)
        self.serving = OpenAIServing.from_llm_config(self.engine, self.llm_config,
                                                     max_pending_requests(self.llm_config))

    async def handle(self, route: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        interval_ms = self.llm_config.experimental_configs.stream_batching_interval_ms
        async for item in coalesce(serve_stream(self.serving, route, body), interval_ms / 1000):
            yield item

    def model_card(self) -> dict[str, Any]:
        return self.serving.model_card()

    async def check_health(self) -> None:
        # Also Serve's periodic replica health check: a dead engine gets the replica replaced.
        await self.serving.check_health()

    def metrics(self) -> list[Any]:
        return self.serving.metrics.families()

    def replica_metrics(self) -> tuple[str | None, list[Any]]:
        """(this Serve replica's id, ``metrics()``): the ingress labels them by replica."""
        from ray import serve
        from ray.serve.exceptions import RayServeException

        try:
            replica_id: str | None = serve.get_replica_context().replica_id.unique_id
        except RayServeException:  # not in a Serve replica (tests)
            replica_id = None
        return replica_id, self.metrics()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's hook, every request_router.stats_period_s: what the routers weigh
        (KV usage, the KV pool in blocks) and the engine series of the ingress's /metrics."""
        stats = routing_stats(await asyncio.to_thread(self.engine.get_stats))
        blocks = kv_pool_blocks(self.engine)
        if blocks is not None:
            stats["num_kv_blocks"] = float(blocks)
        return stats

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for custom autoscaling metrics (autoscaling_config.scale_on
        engine_signals): the engine's waiting and running requests and KV usage."""
        return autoscaling_stats(await asyncio.to_thread(self.engine.get_stats))

    def __del__(self) -> None:
        shutdown_engine(getattr(self, "engine", None))


def kv_pool_blocks(engine: EngineClient) -> int | None:
    """The KV pool of the replica's engine, in blocks (every DP rank's), or None when the
    engine does not say (a custom engine factory's)."""
    return engine.num_kv_blocks if isinstance(engine, KVPoolSized) else None


class _ShutsDown(Protocol):
    def shutdown(self) -> None: ...


def shutdown_engine(engine: _ShutsDown | None) -> None:
    """A replica's engine at the replica's end (its ``__del__``)."""
    if engine is not None:
        try:
            engine.shutdown()
        except Exception as e:  # the process is going away; say why, don't raise
            logger.warning("engine shutdown failed: %r", e)


class LLMIngressServer(LLMServer):
    """One model's replica answering HTTP itself: the app's only deployment with
    ``ingress_in_replica`` (no ingress hop, no handle between the HTTP route and the engine;
    its streams are cut if it dies, as nothing is left to send them an error event)."""

    def __init__(self, llm_config: LLMConfig | dict[str, Any],
                 engine_factory: EngineFactory | None = None,
                 http_server: dict[str, Any] | None = None):
        super().__init__(llm_config, engine_factory)
        self.http_server = HTTPServerConfig.model_validate(http_server or {})

    def __serve_build_asgi_app__(self) -> Any:
        model_id = self.llm_config.model_id
        backend = ModelBackend.local(self.serving, stream=self.handle)
        return build_openai_api({model_id: backend},
                                {model_id: self.llm_config.api_key}, self.http_server)


def handle_backend(handle: Any, model_id: str) -> ModelBackend:
    """An LLMServer deployment seen through its DeploymentHandle."""
    streaming = handle.options(stream=True)

    async def model_card() -> dict[str, Any]:
        return await handle.model_card.remote()

    async def check_health() -> None:
        await handle.check_health.remote()

    async def metrics() -> list[Any]:
        """One replica's series; with the router's view of every replica (it has routed
        a request), the engine's series are every replica's, labelled ``replica``."""
        replica_id, families = await handle.replica_metrics.remote()
        view = find_router_view(handle.app_name, handle.deployment_name)
        if view is None:
            return families
        return with_router_view(families, view, model_id, replica_id)

    def stream(route: str, body: dict[str, Any]) -> Any:
        return streaming.handle.remote(route, body)

    return ModelBackend(stream, model_card, check_health, metrics)


class OpenAIIngress:
    """The HTTP entry: routes by ``model`` to the LLMServer deployments."""

    def __init__(self, llm_handles: dict[str, Any], api_keys: dict[str, str | None],
                 http_server: dict[str, Any] | None = None):
        self._backends = {name: handle_backend(h, name) for name, h in llm_handles.items()}
        self._api_keys = api_keys
        self._http_server = HTTPServerConfig.model_validate(http_server or {})

    def __serve_build_asgi_app__(self) -> Any:
        return build_openai_api(self._backends, self._api_keys, self._http_server)


def deployment_name(model_id: str) -> str:
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)


def runs_model_in_replica(llm_config: LLMConfig) -> bool:
    """TP = PP = DP = 1 without the Ray backend: the replica runs the model itself."""
    ek = llm_config.engine_kwargs
    return (ek.world_size == 1 and ek.data_parallel_size == 1
            and ek.distributed_executor_backend != "ray")


def replica_bundles(llm_config: LLMConfig) -> list[dict[str, float]]:
    """The placement group bundles of one replica. When the replica runs the model itself,
    its bundle must hold the model's device: the replica and rank-0 bundles merge into one
    (a GPU reserved in a bundle the replica does not sit in would stay idle while Ray hides
    every GPU from the replica, and the model would run on its one CPU)."""
    bundles = [dict(b) for b in llm_config.get_placement_group().bundles]
    if runs_model_in_replica(llm_config) and len(bundles) > 1:
        merged = dict(bundles[0])
        for res, amount in bundles[1].items():
            if res != "CPU":  # the replica's CPU is the rank's CPU
                merged[res] = merged.get(res, 0.0) + amount
        bundles = [merged] + bundles[2:]
    return bundles


def request_router_config(llm_config: LLMConfig) -> Any:
    """Serve's RequestRouterConfig of the model's deployment (cluster/serve/deployment/router.py)."""
    from ray.serve.config import RequestRouterConfig

    rr = llm_config.deployment_config.request_router
    kwargs: dict[str, Any] = {}
    if rr.policy == "prefix":
        kwargs = {"llm_config": llm_config.model_dump(mode="json", exclude_unset=True),
                  "imbalance_threshold": rr.imbalance_threshold,
                  "min_match_ratio": rr.min_match_ratio, "ttl_s": rr.entry_ttl_s}
    cls = {"prefix": "PrefixAwareRouter", "pow2": "Pow2Router"}[rr.policy]
    # Ray annotates its __init__'s **kwargs as dict values: pass them as one typed dict.
    options: dict[str, Any] = {
        "request_router_class": f"raylm.cluster.serve.deployment.router:{cls}",
        "request_router_kwargs": kwargs, "request_routing_stats_period_s": rr.stats_period_s}
    return RequestRouterConfig(**options)


def llm_server_options(llm_config: LLMConfig, *, routed: bool = True) -> dict[str, Any]:
    """Serve deployment options: replicas/autoscaling, the TP x PP placement group, and
    (``routed``: behind the ingress deployment) the request router."""
    opts = llm_config.deployment_config.to_serve_options()
    if routed:
        opts["request_router_config"] = request_router_config(llm_config)
    pg = llm_config.get_placement_group()
    bundles = replica_bundles(llm_config)
    replica = bundles[0]
    actor: dict[str, Any] = {"num_cpus": replica.get("CPU", 0), "num_gpus": replica.get("GPU", 0)}
    # Custom resources of the replica's bundle (accelerator_type:..., node labels).
    custom = {k: v for k, v in replica.items() if k not in ("CPU", "GPU")}
    if custom:
        actor["resources"] = custom
    if llm_config.runtime_env:
        actor["runtime_env"] = llm_config.runtime_env
    opts.update(name=deployment_name(llm_config.model_id), ray_actor_options=actor,
                placement_group_bundles=bundles,
                placement_group_strategy=pg.strategy)
    return opts


def ingress_options(app_config: OpenAIAppConfig) -> dict[str, Any]:
    max_replicas = max(c.deployment_config.num_replicas
                       or c.deployment_config.autoscaling_config.max_replicas
                       for c in app_config.llm_configs)
    return {"name": "OpenAIIngress", "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
            "ray_actor_options": {"num_cpus": 0},
            "autoscaling_config": {"min_replicas": 1, "max_replicas": max(1, max_replicas),
                                   "target_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS // 8}}


def with_default_devices(app_config: OpenAIAppConfig) -> OpenAIAppConfig:
    """Each model's ranks take GPUs by default on a cluster that has them (read now, when
    the app is built: a cluster whose GPU nodes are all scaled to zero shows none, so the
    Helm chart sets num_gpus_per_worker itself)."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
    configs = [c.with_default_devices(gpus) for c in app_config.llm_configs]
    for before, after in zip(app_config.llm_configs, configs, strict=True):
        if after is not before:
            logger.info("model %r: the cluster has %g GPUs, each of its ranks takes one "
                        "(num_gpus_per_worker=0 keeps it on CPU).", after.model_id, gpus)
    return app_config.model_copy(update={"llm_configs": configs})


def deployment_of(cls: type) -> Deployment:
    """``serve.deployment(cls)``, typed: Ray annotates serve.deployment as returning the
    decorator, which is what it returns when called bare; applied to ``cls`` it builds the
    same Deployment."""
    from ray import serve

    return serve.deployment()(cls)


def build_app(config: Any, engine_factory: EngineFactory | None = None) -> Any:
    """``build_openai_app`` with an injectable engine factory (tests, custom engines)."""
    from ray import serve

    if isinstance(config, list):
        config = {"llm_configs": config}
    app_config = with_default_devices(load_app_config(config))
    if app_config.ingress_in_replica:
        (llm_config,) = app_config.llm_configs
        # HTTP reaches these replicas straight from the proxy: no handle of ours routes.
        server = deployment_of(serve.ingress()(LLMIngressServer)).options(
            **llm_server_options(llm_config, routed=False))
        return server.bind(llm_config.model_dump(exclude_unset=True), engine_factory,
                           app_config.http_server.model_dump())
    handles = {}
    for llm_config in app_config.llm_configs:
        server = deployment_of(LLMServer).options(**llm_server_options(llm_config))
        handles[llm_config.model_id] = server.bind(llm_config.model_dump(exclude_unset=True), engine_factory)
    ingress = deployment_of(serve.ingress()(OpenAIIngress)).options(
        **ingress_options(app_config))
    api_keys = {c.model_id: c.api_key for c in app_config.llm_configs}
    return ingress.bind(handles, api_keys, app_config.http_server.model_dump())


def build_openai_app(args: Any) -> Any:
    """The Serve app builder: ``args`` is ``{"llm_configs": [<LLMConfig dict>, ...]}``
    (or an LLMConfig, a list of them, or anything ``load_app_config`` accepts)."""
    if isinstance(args, LLMConfig):
        args = [args]
    if isinstance(args, list):
        args = {"llm_configs": [c.model_dump(exclude_unset=True) if isinstance(c, LLMConfig) else c
                                for c in args]}
    return build_app(args)
