"""The OpenAI HTTP surface (FastAPI), written against model backends; no Ray in here.

In Ray Serve a backend wraps the DeploymentHandle of an ``LLMServer`` replica
(``raylm.cluster.serve.app``); in tests and in-process it is a ``LocalBackend`` around an
``OpenAIServing``. A backend's ``stream(route, body)`` yields, first, either
``("json", status, body)`` (a whole response or an error) or the first SSE line, then the
remaining SSE lines. That first item decides the HTTP status before any byte is sent.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from raylm.cluster.serve import metrics as metrics_mod
from raylm.cluster.serve.errors import OpenAIError, error_body, from_exception, pydantic_message
from raylm.cluster.serve.prepared import CHAT_COMPLETIONS, COMPLETIONS
from raylm.cluster.serve.serving import OpenAIServing


class ModelBackend(Protocol):
    def stream(self, route: str, body: dict[str, Any]) -> AsyncIterator[Any]: ...
    async def model_card(self) -> dict[str, Any]: ...
    async def check_health(self) -> None: ...
    async def metrics(self) -> list[Any]: ...


async def serve_stream(serving: OpenAIServing, route: str, body: Any) -> AsyncIterator[Any]:
    """One API call as the item stream described in the module docstring."""
    try:
        result = await serving.handle(route, body)
    except Exception as e:  # from_exception logs what is not the client's fault
        err = from_exception(e)
        yield ("json", err.status_code, err.to_dict())
        return
    if isinstance(result, dict):
        yield ("json", 200, result)
        return
    async with aclosing(result) as lines:
        async for line in lines:
            yield line


class LocalBackend:
    """A backend in this process (tests, and anything that owns its engine directly)."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    def stream(self, route: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        return serve_stream(self.serving, route, body)

    async def model_card(self) -> dict[str, Any]:
        return self.serving.model_card()

    async def check_health(self) -> None:
        await self.serving.check_health()

    async def metrics(self) -> list[Any]:
        return self.serving.metrics.families()


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code)


async def _close(stream: Any) -> None:
    if hasattr(stream, "aclose"):
        await stream.aclose()
    elif hasattr(stream, "cancel"):  # a Serve DeploymentResponseGenerator
        stream.cancel()


async def _rest(first: str, stream: Any) -> AsyncIterator[str]:
    finished = False
    try:
        yield first
        try:
            async for line in stream:
                yield line
        except Exception as e:  # noqa: BLE001 - the replica (or its node) died mid-stream
            # The status line is long sent: end the stream with an error event the client
            # can parse, not a connection cut in the middle of a chunk.
            err = from_exception(e)
            yield f"data: {json.dumps(err.to_dict())}\n\n"
        finished = True
    finally:
        if not finished:  # the client went away: stop the generation behind it
            await _close(stream)


class OpenAIRoutes:
    """The steps of one API call: authenticate, parse the body, pick the model's backend,
    then answer with its first item (a JSON response) or stream the rest as SSE.

    ``backends`` maps served model ids to backends; ``api_keys`` maps model ids to the
    Bearer token their requests need (None: open)."""

    def __init__(self, backends: Mapping[str, ModelBackend],
                 api_keys: Mapping[str, str | None] | None = None):
        self.backends = backends
        self.keys = {k: v for k, v in (api_keys or {}).items() if v}

    def check_auth(self, request: Request, model: str | None) -> None:
        """A model's own key, any key when no model is named; nothing when open."""
        keys = self.keys
        needed = [keys[model]] if model in keys else ([] if model else list(keys.values()))
        if not needed:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in needed):
            raise OpenAIError("Invalid or missing API key (send 'Authorization: Bearer <key>').",
                              401)

    def backend_for(self, model: Any) -> tuple[str, ModelBackend]:
        backends = self.backends
        if model is None:
            if len(backends) == 1:
                return next(iter(backends.items()))
            raise OpenAIError(f"model is required; this server serves {sorted(backends)}.",
                              400, "model")
        if not isinstance(model, str) or model not in backends:
            raise OpenAIError(f"The model `{model}` does not exist; this server serves "
                              f"{sorted(backends)}.", 404, "model")
        return model, backends[model]

    async def parse_body(self, request: Request) -> dict[str, Any]:
        """The JSON object of the body; authenticates first (a bad body from a client
        without the key is a 401, not a 400)."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.check_auth(request, None)
            raise OpenAIError(f"The request body is not valid JSON: {e}", 400) from e
        if not isinstance(body, dict):
            self.check_auth(request, None)
            raise OpenAIError("The request body must be a JSON object, got "
                              f"{type(body).__name__}.", 400)
        model = body.get("model")
        self.check_auth(request, model if isinstance(model, str) else None)
        return body

    async def dispatch(self, route: str, request: Request) -> Response:
        body = await self.parse_body(request)
        name, backend = self.backend_for(body.get("model"))
        body["model"] = name
        return await respond(backend.stream(route, body))

    async def models(self, request: Request) -> dict[str, Any]:
        self.check_auth(request, None)
        cards = await asyncio.gather(*(b.model_card() for b in self.backends.values()))
        return {"object": "list", "data": list(cards)}

    async def health(self) -> Response:
        results = await asyncio.gather(*(b.check_health() for b in self.backends.values()),
                                       return_exceptions=True)
        for name, result in zip(self.backends, results, strict=True):
            if isinstance(result, BaseException):
                return _error(OpenAIError(f"model {name!r} is unhealthy: {result}", 503))
        return Response(status_code=200)

    async def metrics(self) -> Response:
        groups = await asyncio.gather(*(b.metrics() for b in self.backends.values()),
                                      return_exceptions=True)
        ok = [g for g in groups if not isinstance(g, BaseException)]
        return Response(metrics_mod.render(ok), media_type=metrics_mod.CONTENT_TYPE)


async def respond(stream: Any) -> Response:
    """The HTTP response for a backend's item stream: its first item decides the status."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return _error(OpenAIError("the model server returned nothing", 500))
    except Exception as e:
        return _error(from_exception(e))
    if isinstance(first, (tuple, list)) and first and first[0] == "json":
        await _close(stream)
        return JSONResponse(first[2], status_code=first[1])
    return StreamingResponse(_rest(first, stream), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app reports, FastAPI's and Starlette's included, in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = pydantic_message(exc)
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), exc.status_code),
                            status_code=exc.status_code)

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError):
        return _error(exc)


def build_openai_api(backends: Mapping[str, ModelBackend],
                     api_keys: Mapping[str, str | None] | None = None) -> FastAPI:
    """The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    (see ``OpenAIRoutes`` for the arguments)."""
    routes = OpenAIRoutes(backends, api_keys)
    app = FastAPI(title="raylm OpenAI-compatible API", docs_url=None, redoc_url=None)
    add_error_handlers(app)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await routes.dispatch(COMPLETIONS, request)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(request: Request) -> Response:
        return await routes.dispatch(CHAT_COMPLETIONS, request)

    app.get("/v1/models")(routes.models)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.metrics)
    return app
