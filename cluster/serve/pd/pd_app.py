"""The prefill/decode disaggregated OpenAI app, shaped like Ray Serve LLM's PD app: a proxy
deployment (the OpenAI routes, no model) in front of a prefill deployment and a decode
deployment, each from its own LLMConfig with its own replicas or autoscaling, its own
TP size and engine arguments.

From a Serve config::

    applications:
    - name: raylm-pd
      import_path: raylm.cluster.serve.pd.pd_app:build_pd_openai_app
      args:
        prefill_config: {model_loading_config: {...}, engine_kwargs: {...},
                         deployment_config: {num_replicas: 1}}
        decode_config: {model_loading_config: {...}, deployment_config: {num_replicas: 2}}

Each side gets the RayKVConnector in its role (``kv_producer`` / ``kv_consumer``) and the
Ray executor backend unless its ``engine_kwargs`` name them; the proxy's routing, failure
handling and metrics are ``pd_client.PDEngineClient``'s. /v1/embeddings runs on the decode
side's engine alone, its prompts computed there (no prefill hop: an embedding's answer is
its prompt's hidden states, not KV), pooled the decode config's ``pooling_type`` way.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import ValidatedPrompt
from raylm.cluster.serve.deployment.app import (
    LLMIngressServer,
    deployment_of,
    llm_server_options,
    shutdown_engine,
)
from raylm.cluster.serve.deployment.config import LLMConfig
from raylm.cluster.serve.deployment.deployment_config import DeploymentConfig
from raylm.cluster.serve.pd.pd_client import PDEngineClient
from raylm.cluster.serve.pd.pd_engines import DECODE_KV, PREFILL_KV, DecodeEngine, PrefillEngine


class PDServingArgs(BaseModel):
    """The args of ``build_pd_openai_app`` (Ray Serve LLM's PD app's, without its
    ``proxy_cls_config``: the proxy is raylm's)."""

    model_config = ConfigDict(extra="forbid")

    prefill_config: LLMConfig
    decode_config: LLMConfig
    proxy_deployment_config: DeploymentConfig = Field(
        default_factory=lambda: DeploymentConfig(num_replicas=1, max_ongoing_requests=1024))

    @model_validator(mode="after")
    def _same_model(self) -> PDServingArgs:
        p, d = self.prefill_config.model_loading_config, self.decode_config.model_loading_config
        if p.model_source != d.model_source:
            raise ValueError(f"prefill_config and decode_config must serve one model, got "
                             f"model_source {p.model_source!r} and {d.model_source!r}.")
        for name in ("prefill_config", "decode_config"):
            if getattr(self, name).engine_kwargs.enable_lora:
                raise ValueError(f"{name}.engine_kwargs.enable_lora: the prefill/decode app "
                                 "serves the base model only (a request's adapter does not "
                                 "travel with its KV); serve LoRA adapters with the OpenAI app.")
        return self

    def side(self, role: str) -> LLMConfig:
        """A side's LLMConfig with its connector role and the Ray executor backend filled
        in."""
        config = self.prefill_config if role == "prefill" else self.decode_config
        data = config.model_dump(exclude_unset=True)
        kwargs = dict(data.get("engine_kwargs") or {})
        kwargs.setdefault("kv_transfer_config", PREFILL_KV if role == "prefill" else DECODE_KV)
        kwargs.setdefault("distributed_executor_backend", "ray")  # the replica's bundles
        return LLMConfig.model_validate({**data, "engine_kwargs": kwargs})


# ---- the deployments -------------------------------------------------------------------

def _async_llm(llm_config: dict[str, Any]) -> Any:
    from raylm.cluster.engine.async_llm import AsyncLLM

    return AsyncLLM.from_llm_config(LLMConfig.model_validate(llm_config))


class _Replica:
    """A replica of one side: its engine's stats, health (Serve's replica health check
    too) and shutdown."""

    engine: Any

    async def get_stats(self) -> dict[str, Any]:
        return await self.engine.get_stats()

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        shutdown_engine(getattr(self, "engine", None))


class PDPrefillServer(_Replica):
    """One prefill replica: its engine keeps each prompt's KV for a decode replica."""

    def __init__(self, llm_config: dict[str, Any]) -> None:
        self.engine = PrefillEngine(_async_llm(llm_config))

    async def prefill(self, request_id: str, prompt: ValidatedPrompt) -> dict[str, Any]:
        return await self.engine.prefill(request_id, prompt)

    async def release(self, request_ids: list[str]) -> None:
        await self.engine.release(request_ids)


class PDDecodeServer(_Replica):
    """One decode replica: pulls each prompt's KV and streams the request's outputs."""

    def __init__(self, llm_config: dict[str, Any]) -> None:
        self.engine = DecodeEngine(_async_llm(llm_config))

    async def generate(self, request_id: str, prompt: ValidatedPrompt,
                       kv_transfer_params: dict[str, Any] | None
                       ) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(request_id, prompt, kv_transfer_params):
            yield out


class _Remote:
    """A side's deployment as PDEngineClient's backend: each method an awaitable call."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)

        async def call(*args: Any) -> Any:
            response = method.remote(*args)
            try:
                return await response
            except asyncio.CancelledError:  # the client left: the replica stops too
                response.cancel()
                raise

        return call


class _RemoteDecode(_Remote):
    """The decode deployment: ``generate`` streams, and is cancelled when its consumer
    stops reading (the decode replica then aborts the request)."""

    async def generate(self, request_id: str, prompt: ValidatedPrompt,
                       kv_transfer_params: dict[str, Any] | None
                       ) -> AsyncIterator[RequestOutput]:
        stream = self._handle.options(stream=True).generate.remote(
            request_id, prompt, kv_transfer_params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.cancel()


def _proxy_engine(llm_config: LLMConfig, prefill: Any, decode: Any) -> PDEngineClient:
    from raylm.cluster.engine.engine_setup import load_tokenizer

    model_config = llm_config.engine_args().create_model_config()
    return PDEngineClient(model_config, load_tokenizer(str(model_config.tokenizer)),
                          _Remote(prefill), _RemoteDecode(decode))


class PDProxyServer(LLMIngressServer):
    """The OpenAI routes over the two deployments (no model here: the tokenizer and the
    intake only)."""

    def __init__(self, llm_config: dict[str, Any], prefill: Any, decode: Any) -> None:
        super().__init__(llm_config, engine_factory=functools.partial(
            _proxy_engine, prefill=prefill, decode=decode))


# ---- the app ---------------------------------------------------------------------------

def _name(kind: str, model_id: str) -> str:
    return f"PD{kind}:" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)


def build_pd_app(args: PDServingArgs | dict[str, Any]) -> Any:
    from ray import serve

    if not isinstance(args, PDServingArgs):
        args = PDServingArgs.model_validate(args)
    import ray

    gpus = ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
    prefill_cfg, decode_cfg = (args.side(role).with_default_devices(gpus)
                               for role in ("prefill", "decode"))
    model_id = decode_cfg.model_id
    prefill = deployment_of(PDPrefillServer).options(
        **{**llm_server_options(prefill_cfg), "name": _name("Prefill", model_id)}).bind(
        prefill_cfg.model_dump(exclude_unset=True))
    decode = deployment_of(PDDecodeServer).options(
        **{**llm_server_options(decode_cfg), "name": _name("Decode", model_id)}).bind(
        decode_cfg.model_dump(exclude_unset=True))
    proxy_opts = args.proxy_deployment_config.to_serve_options()
    proxy_opts.update(name=_name("Proxy", model_id), ray_actor_options={"num_cpus": 1})
    proxy = deployment_of(serve.ingress()(PDProxyServer)).options(**proxy_opts)
    return proxy.bind(decode_cfg.model_dump(exclude_unset=True), prefill, decode)


def build_pd_openai_app(args: Any) -> Any:
    """The Serve app builder (``import_path: raylm.cluster.serve.pd.pd_app:build_pd_openai_app``):
    ``args`` is ``{"prefill_config": <LLMConfig>, "decode_config": <LLMConfig>}``."""
    return build_pd_app(args)
