"""The OpenAI HTTP surface (FastAPI), written against model backends; no Ray in here.

In Ray Serve a backend wraps the DeploymentHandle of an ``LLMServer`` replica
(``raylm.cluster.serve.deployment.app``); in the replica itself, in tests and in-process it is
``ModelBackend.local`` around an ``OpenAIServing``. A backend's ``stream(route, body)`` yields, first, either
``("json", status, body)`` (a whole response or an error) or the first SSE line, then the
remaining SSE lines. That first item decides the HTTP status before any byte is sent.

What a hostile client meets before any model code runs (``HTTPServerConfig``): with API
keys, every route but /health (and /metrics when public) answers 401 without one, the
keys compared in constant time; a body over ``max_request_body_bytes`` is a 413 (refused
from its Content-Length, or as soon as it grows past the limit); a body that is not JSON,
holds NaN or Infinity, numbers out of range, a lone UTF-16 surrogate, or nesting deeper
than ``max_json_depth`` is a 400. Every error is OpenAI's error JSON, an unexpected one
included (a 500 that names no file or frame). /openapi.json documents every request body
with the pydantic models the routes parse them with.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from raylm import __version__
from raylm.cluster.serve.deployment import metrics as metrics_mod
from raylm.cluster.serve.deployment.deployment_config import HTTPServerConfig
from raylm.cluster.serve.handlers.lora_routes import (
    ADAPTERS_KEY,
    LOAD_LORA,
    UNLOAD_LORA,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from raylm.cluster.serve.handlers.responses import DONE as SSE_DONE
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api import prepared
from raylm.cluster.serve.openai_api.chat_protocol import ChatCompletionRequest
from raylm.cluster.serve.openai_api.embedding_protocol import EmbeddingRequest
from raylm.cluster.serve.openai_api.errors import (
    OpenAIError,
    error_body,
    from_exception,
    pydantic_message,
)
from raylm.cluster.serve.openai_api.protocol import CompletionRequest
from raylm.cluster.serve.openai_api.response_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

# Routes that answer without an API key: a load balancer's health probe.
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class ModelBackend:
    """How the routes reach one model: four calls, which are all that differs between a
    model served in this process (``local``) and one behind a Serve DeploymentHandle
    (``raylm.cluster.serve.deployment.app.handle_backend``)."""

    stream: Callable[[str, dict[str, Any]], Any]  # the item stream described above
    model_card: Callable[[], Awaitable[dict[str, Any]]]
    check_health: Callable[[], Awaitable[None]]
    metrics: Callable[[], Awaitable[list[Any]]]  # Prometheus metric families

    @classmethod
    def local(cls, serving: OpenAIServing,
              stream: Callable[[str, dict[str, Any]], Any] | None = None) -> ModelBackend:
        """``serving`` in this process; ``stream`` replaces ``serve_stream`` over it (a
        replica's coalesces the SSE lines)."""

        async def model_card() -> dict[str, Any]:
            return serving.model_card()

        async def metrics() -> list[Any]:
            return serving.metrics.families()

        def default_stream(route: str, body: dict[str, Any]) -> AsyncIterator[Any]:
            return serve_stream(serving, route, body)

        return cls(stream or default_stream, model_card, serving.check_health, metrics)


async def serve_stream(serving: OpenAIServing, route: str, body: Any
                       ) -> AsyncGenerator[Any, None]:
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


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code)


def _ends_stream(line: Any) -> bool:
    """Whether an SSE item holds the stream's last event (``data: [DONE]``)."""
    return isinstance(line, str) and line.endswith(SSE_DONE)


async def _close(stream: Any) -> None:
    if hasattr(stream, "aclose"):
        await stream.aclose()
    elif hasattr(stream, "cancel"):  # a Serve DeploymentResponseGenerator
        stream.cancel()


async def _rest(first: str, stream: Any) -> AsyncIterator[str]:
    finished = False
    done = _ends_stream(first)
    try:
        yield first
        try:
            async for line in stream:
                if not done:
                    yield line
                    done = _ends_stream(line)
        except Exception as e:  # noqa: BLE001 - the replica (or its node) died mid-stream
            # The status line is long sent: end the stream with an error event the client
            # can parse, not a connection cut in the middle of a chunk. After [DONE] the
            # client has the whole answer: a replica that dies before its generator's end
            # reaches us (the chaos soak saw it) changes nothing for it.
            if not done:
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
                 api_keys: Mapping[str, str | None] | None = None,
                 http: HTTPServerConfig | None = None):
        self.backends = backends
        self.keys = {k: v for k, v in (api_keys or {}).items() if v}
        # Digests, compared in constant time whatever the length of what a client sends.
        self._digests = {k: _digest(v) for k, v in self.keys.items()}
        self.http = http or HTTPServerConfig()

    def authorized(self, headers: Headers, model: str | None) -> bool:
        """A model's own key, any key when no model is named; anything when open. Every
        candidate key is compared (no early exit), each in constant time."""
        digests = self._digests
        needed = ([digests[model]] if model in digests
                  else ([] if model else list(digests.values())))
        if not needed:
            return True
        header = headers.get("authorization", "")
        sent = _digest(header[7:] if header.lower().startswith("bearer ") else "")
        matches = [hmac.compare_digest(sent, d) for d in needed]
        return any(matches)

    def check_auth(self, request: Request, model: str | None) -> None:
        if not self.authorized(request.headers, model):
            raise unauthorized()

    def backend_for(self, model: Any) -> tuple[str, ModelBackend]:
        backends = self.backends
        if model is None:
            if len(backends) == 1:
                return next(iter(backends.items()))
            raise OpenAIError(f"model is required; this server serves {sorted(backends)}.",
                              400, "model")
        name = self._backend_name(model)
        if name is None:
            raise OpenAIError(f"The model `{model}` does not exist; this server serves "
                              f"{sorted(backends)}.", 404, "model")
        return model, backends[name]  # an adapter keeps its name: the replica resolves it

    async def read_body(self, request: Request) -> bytes:
        """The raw body, at most ``max_request_body_bytes`` of it (413 beyond)."""
        limit = self.http.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse_body(self, request: Request) -> dict[str, Any]:
        """The JSON object of the body; authenticates first (a bad body from a client
        without the key is a 401, not a 400: the middleware asked for any key, this asks
        for the model's)."""
        body = parse_json(await self.read_body(request), self.http.max_json_depth)
        model = body.get("model")
        self.check_auth(request, self._backend_name(model) or
                        (model if isinstance(model, str) else None))
        return body

    def _backend_name(self, model: Any) -> str | None:
        """The backend that serves ``model``: its own, the base of a LoRA adapter named
        ``base:adapter``, or with one backend any other name (an adapter its replica may
        serve; it answers 404 if not). None where none does."""
        backends = self.backends
        if not isinstance(model, str):
            return None
        if model in backends:
            return model
        base = model.partition(":")[0]
        if base in backends:
            return base
        return next(iter(backends)) if len(backends) == 1 else None

    async def dispatch(self, route: str, request: Request) -> Response:
        body = await self.parse_body(request)
        name, backend = self.backend_for(body.get("model"))
        body["model"] = name
        return await respond(backend.stream(route, body))

    async def models(self, request: Request) -> dict[str, Any]:
        cards = await asyncio.gather(*(b.model_card() for b in self.backends.values()))
        data = []
        for card in cards:  # a model, then its LoRA adapters (each with its parent)
            card = dict(card)
            adapters = card.pop(ADAPTERS_KEY, [])
            data += [card, *adapters]
        return {"object": "list", "data": data}

    async def model(self, model_id: str) -> dict[str, Any]:
        """One model's card (``client.models.retrieve``), a LoRA adapter's included."""
        _, backend = self.backend_for(model_id)
        card = dict(await backend.model_card())
        adapters = card.pop(ADAPTERS_KEY, [])
        if model_id == card.get("id"):
            return card
        name = model_id.partition(":")[2] or model_id
        for adapter in adapters:
            if adapter["id"] == name:
                return adapter
        raise OpenAIError(f"The model `{model_id}` does not exist.", 404, "model")

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


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def unauthorized() -> OpenAIError:
    return OpenAIError("Invalid or missing API key (send 'Authorization: Bearer <key>').", 401)


def too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(f"The request body has at least {size} bytes, more than the {limit} "
                       "this server accepts (max_request_body_bytes).", 413)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (non-finite numbers are refused)")


def parse_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, or an OpenAIError(400) saying what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise OpenAIError(f"The request body is nested more than {max_depth} levels deep "
                          "(max_json_depth).", 400) from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise OpenAIError(f"The request body is not valid JSON: {e}", 400) from None
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object, got "
                          f"{type(body).__name__}.", 400)
    problem = json_problem(body, max_depth)
    if problem is not None:
        raise OpenAIError(problem[0], 400, problem[1])
    return body


def json_problem(value: Any, max_depth: int) -> tuple[str, str | None] | None:
    """What makes a decoded body unfit for the models, and the top-level field it is in;
    None if nothing: nesting deeper than ``max_depth``, a number that overflowed to
    infinity (``1e999``), text that is not valid Unicode (a lone surrogate, which JSON's
    ``\\ud800`` escape allows)."""
    stack: list[tuple[Any, int, str, str | None]] = [(value, 1, "body", None)]
    while stack:
        node, depth, path, field = stack.pop()
        if isinstance(node, (dict, list)) and depth > max_depth:
            return (f"The request body is nested more than {max_depth} levels deep at "
                    f"{path} (max_json_depth).", field)
        if isinstance(node, dict):
            for key, item in node.items():
                top = field or _ascii(key)
                stack.append((key, depth, path, top))
                stack.append((item, depth + 1, f"{path}.{_ascii(key)}", top))
        elif isinstance(node, list):
            if _fine_scalars(node):  # a prompt of token ids, of texts: no walk in Python
                continue
            stack.extend((item, depth + 1, f"{path}[{i}]", field) for i, item in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            return f"{path} is a number out of range (it overflows to infinity).", field
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as e:
                return (f"{path} is not valid Unicode: it holds a lone UTF-16 surrogate "
                        f"(\\u{ord(node[e.start]):04x}) at character {e.start}; send UTF-8 "
                        "text.", field)
    return None


_PLAIN = frozenset({int, bool, type(None)})


def _fine_scalars(items: list[Any]) -> bool:
    """True when ``items`` are all scalars with nothing wrong (checked in C-speed passes);
    False when the walk must look at them one by one (containers, or a bad one among
    them, which the walk then finds and names)."""
    kinds = set(map(type, items))
    if kinds <= _PLAIN:
        return True
    if kinds == {str}:
        try:
            "".join(items).encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if kinds <= _PLAIN | {float}:
        return all(map(math.isfinite, (x for x in items if type(x) is float)))
    return False


def _ascii(key: str) -> str:
    return key.encode("ascii", "backslashreplace").decode("ascii")[:64]


class APIKeyMiddleware:
    """401 for a request without any valid key, before its body is read; /health (and
    /metrics when public) and CORS preflights pass. The model's own key is checked once
    the body names the model (``OpenAIRoutes.parse_body``)."""

    def __init__(self, app: Any, routes: OpenAIRoutes, open_paths: frozenset[str]) -> None:
        self.app = app
        self.routes = routes
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and self.routes.keys
                and scope["path"] not in self.open_paths and scope["method"] != "OPTIONS"
                and not self.routes.authorized(Headers(scope=scope), None)):
            await _error(unauthorized())(scope, receive, send)
            return
        await self.app(scope, receive, send)


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

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        return _error(from_exception(exc))  # logged there, with its traceback


# The request body each POST route parses (documented in /openapi.json).
REQUEST_BODIES: dict[str, list[type[BaseModel]]] = {
    prepared.COMPLETIONS: [CompletionRequest],
    prepared.CHAT_COMPLETIONS: [ChatCompletionRequest],
    prepared.EMBEDDINGS: [EmbeddingRequest],
    prepared.TOKENIZE: [TokenizeCompletionRequest, TokenizeChatRequest],
    prepared.DETOKENIZE: [DetokenizeRequest],
    LOAD_LORA: [LoadLoRAAdapterRequest],
    UNLOAD_LORA: [UnloadLoRAAdapterRequest],
}


def _body_doc(models: list[type[BaseModel]]) -> dict[str, Any]:
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _document_bodies(app: FastAPI) -> None:
    """/openapi.json with the request models' schemas among its components (the routes read
    their bodies themselves, to authenticate and bound them first)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for models in REQUEST_BODIES.values():
                for model in models:
                    js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    components.update(js.pop("$defs", {}))
                    components[model.__name__] = js
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def build_openai_api(backends: Mapping[str, ModelBackend],
                     api_keys: Mapping[str, str | None] | None = None,
                     http: HTTPServerConfig | None = None) -> FastAPI:
    """The FastAPI app: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models,
    /tokenize, /detokenize, /version, /health, /metrics (see ``OpenAIRoutes`` for the arguments;
    ``http``: CORS, limits, whether /metrics needs the key)."""
    routes = OpenAIRoutes(backends, api_keys, http)
    http = routes.http
    app = FastAPI(title="raylm OpenAI-compatible API", version=__version__, docs_url=None,
                  redoc_url=None)
    add_error_handlers(app)

    def post(route: str) -> None:
        async def handler(request: Request) -> Response:
            return await routes.dispatch(route, request)

        handler.__name__ = route.strip("/").replace("/", "_")
        app.post(route, openapi_extra=_body_doc(REQUEST_BODIES[route]))(handler)

    for route in REQUEST_BODIES:
        post(route)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.metrics)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    _document_bodies(app)
    open_paths = OPEN_PATHS | ({"/metrics"} if http.public_metrics else set())
    app.add_middleware(APIKeyMiddleware, routes=routes, open_paths=frozenset(open_paths))
    if http.allowed_origins:  # outermost: preflights are answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=http.allowed_origins,
                           allow_methods=http.allowed_methods,
                           allow_headers=http.allowed_headers,
                           allow_credentials=http.allow_credentials)
    return app
