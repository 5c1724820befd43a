"""OpenAI completions, chat completions and embeddings over an EngineClient: validate,
run, format.

One code path for the HTTP server and for batch runs; a call returns a response dict or an
async iterator of SSE lines. Every prompt goes once through the engine client's intake
(``input_processor.process``) before anything runs; what fails there is a 400
(``raylm.cluster.serve.openai_api.errors``). A structured-output spec (the request's, or the grammar
of a required or named tool call) is compiled first, off the event loop and within
``grammar_compile_timeout_s``, so the intake then finds it checked and no request waits
for another's grammar. Streams are primed (their first output awaited) before returning,
so an engine-side refusal is a 400 too, not a broken stream. An embeddings call
(/v1/embeddings) makes one engine request per input, all run at once, admitted, awaited,
released and aborted as a completion's prompts are; each returns its pooled vector
(``SamplingParams.pooling``, pooled the server's ``pooling_type`` way). Also /tokenize
and /detokenize (vLLM's shapes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from raylm.cluster.engine.chat_utils import apply_chat_template
from raylm.cluster.engine.engine_protocol import EngineClient
from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import check_text
from raylm.cluster.serve.deployment.metrics import ServingMetrics
from raylm.cluster.serve.handlers import responses as openai_responses
from raylm.cluster.serve.handlers.lora_routes import (
    ADAPTERS_KEY,
    LOAD_LORA,
    UNLOAD_LORA,
    LoadLoRAAdapterRequest,
    LoRAModules,
    UnloadLoRAAdapterRequest,
)
from raylm.cluster.serve.openai_api.chat_protocol import ChatCompletionRequest
from raylm.cluster.serve.openai_api.embedding_protocol import EmbeddingRequest, embedding_response
from raylm.cluster.serve.openai_api.errors import (
    OpenAIError,
    bad_request,
    from_exception,
    not_found,
    overloaded,
    pydantic_message,
)
from raylm.cluster.serve.openai_api.prepared import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    DETOKENIZE,
    EMBEDDINGS,
    TOKENIZE,
    EngineRequest,
    PreparedRequest,
)
from raylm.cluster.serve.openai_api.protocol import (
    CompletionRequest,
    ignored_fields,
    random_id,
    refused_fields,
)
from raylm.cluster.serve.openai_api.response_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from raylm.cluster.serve.tools.tool_parsers import ChatOutputParser
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.lora import LoRARequest
from raylm.scheduler.pooling_params import PoolingParams
from raylm.scheduler.request import InvalidRequestError
from raylm.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OpenAIServing:
    """Serves one model. ``max_pending_requests`` bounds the sequences in flight (running
    plus queued, n counted per request); beyond it requests get 503 at once.
    ``tool_call_parser`` and ``reasoning_parser`` (vLLM's names) say how the model writes
    tool calls and reasoning (``raylm.cluster.serve.tools.tool_parsers``); ``pooling_type``
    how /v1/embeddings pools a prompt's hidden states ("last" or "mean")."""

    def __init__(self, engine: EngineClient, served_model_name: str | None = None,
                 max_pending_requests: int | None = None,
                 metrics: ServingMetrics | None = None, *,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 loras: LoRAModules | None = None, pooling_type: str = "last"):
        self.engine = engine
        self.model_name = served_model_name or engine.model_config.name
        self.max_model_len = engine.model_config.max_model_len
        self.max_pending_requests = max_pending_requests
        self.metrics = metrics or ServingMetrics(self.model_name, engine.get_stats)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.pooling_type = PoolingParams(pooling_type).pooling_type  # checked here, once
        # Engine request id -> sequences (n) admitted and not yet finished. Keyed, not a bare
        # counter, so that releasing twice, or a stream that never started, stays correct.
        self._pending: dict[str, int] = {}
        # LoRA adapters served as models of their own (lora_routes.py); None without LoRA.
        self.loras = loras

    @classmethod
    def from_llm_config(cls, engine: EngineClient, llm_config: Any,
                        max_pending_requests: int | None = None) -> OpenAIServing:
        """The serving of one replica of a Serve ``LLMConfig``."""
        ek = llm_config.engine_kwargs
        loras = LoRAModules.from_engine_kwargs(ek, llm_config.model_id, engine)
        return cls(engine, llm_config.model_id, max_pending_requests,
                   tool_call_parser=ek.tool_call_parser, reasoning_parser=ek.reasoning_parser,
                   loras=loras, pooling_type=ek.pooling_type)

    # ---- model information ---------------------------------------------------------------
    def model_card(self) -> dict[str, Any]:
        """The model's card; with LoRA, its adapters' cards under ``ADAPTERS_KEY`` (the
        routes list them as models of their own)."""
        card = ModelCard(id=self.model_name, root=self.engine.model_config.model,
                         max_model_len=self.max_model_len).model_dump()
        if self.loras is not None:
            card[ADAPTERS_KEY] = self.loras.cards()
        return card

    async def check_health(self) -> None:
        await self.engine.check_health()

    @property
    def num_pending(self) -> int:
        """Sequences in flight (a request with n=4 counts 4, as in the engine's batch)."""
        return sum(self._pending.values())

    # ---- entry points ----------------------------------------------------------------------
    async def handle(self, route: str, body: Any
                     ) -> dict[str, Any] | AsyncGenerator[str, None]:
        """Run one API call; raises OpenAIError for anything the client did wrong."""
        if route == TOKENIZE:
            return self.tokenize(body)
        if route == DETOKENIZE:
            return self.detokenize(body)
        if route in (LOAD_LORA, UNLOAD_LORA):
            if self.loras is None:
                raise bad_request("this server runs without LoRA (enable_lora).", "lora_name")
            self.loras.check_runtime_loading()
            model: type[LoadLoRAAdapterRequest | UnloadLoRAAdapterRequest] = (
                LoadLoRAAdapterRequest if route == LOAD_LORA else UnloadLoRAAdapterRequest)
            return self.loras.handle(_parse(model, body))
        request = self.parse(route, body)
        try:
            constraint = request.structured_outputs_params()
        except ValueError as e:
            raise bad_request(str(e), _field_of(e, request)) from e
        if constraint is not None:
            try:
                await self.engine.input_processor.precheck_structured_outputs(constraint)
            except InvalidRequestError as e:
                raise bad_request(str(e), e.param) from e
        return await self.run(self.prepare(route, request))

    def parse(self, route: str, body: Any
              ) -> CompletionRequest | ChatCompletionRequest | EmbeddingRequest:
        """The request model of ``route``: 400 for a malformed body or a field raylm
        refuses (``UNSUPPORTED_FIELDS``), 404 for another model or route."""
        model: type[CompletionRequest | ChatCompletionRequest | EmbeddingRequest]
        if route == COMPLETIONS:
            model = CompletionRequest
        elif route == CHAT_COMPLETIONS:
            model = ChatCompletionRequest
        elif route == EMBEDDINGS:
            model = EmbeddingRequest
        else:
            raise not_found(f"route {route!r} does not exist.")
        request = _parse(model, body)
        self._check_model(request.model)
        refused = refused_fields(request)
        if refused:
            raise bad_request("unsupported field(s): " + "; ".join(refused) + ".",
                              refused[0].split(" ", 1)[0])
        ignored = ignored_fields(request)
        if ignored:
            logger.info("request fields ignored (unknown to raylm): %s", ignored)
        if isinstance(request, ChatCompletionRequest) and request.tool_mode == "auto" \
                and self.tool_call_parser is None:
            raise bad_request(
                "tool_choice 'auto' (the default when tools are given) needs the server "
                "started with a tool_call_parser (raylm serve --tool-call-parser hermes, "
                "or engine_kwargs.tool_call_parser); send tool_choice 'required', 'none' or "
                "a named function to call tools without one.", "tool_choice")
        return request

    def prepare(self, route: str, body: Any) -> PreparedRequest:
        prompts: list[Any]
        request = body if isinstance(
            body, (CompletionRequest, ChatCompletionRequest, EmbeddingRequest)) \
            else self.parse(route, body)
        output_parser = None
        if isinstance(request, (CompletionRequest, EmbeddingRequest)):
            prompts = request.prompts()  # text, or token ids (never tokenized)
            prefix = "cmpl" if isinstance(request, CompletionRequest) else "embd"
        else:
            prompts = [self._apply_chat_template(request)]
            prefix = "chatcmpl"
            output_parser = partial(
                ChatOutputParser, request.tool_mode, request.named_function,
                self.tool_call_parser, self.reasoning_parser, request.parallel_tool_calls)
        response_id = random_id(prefix)
        intake = self.engine.input_processor
        params = partial(self._sampling_params, request)
        lora = self._check_model(request.model)
        try:
            engine_requests = [
                EngineRequest(f"{response_id}-{i}", intake.process(
                    prompt, params, strict_max_tokens=True, lora_request=lora))
                for i, prompt in enumerate(prompts)
            ]
        except InvalidRequestError as e:  # an embedding's prompts are its field "input"
            if isinstance(request, EmbeddingRequest) and e.param == "prompt":
                raise bad_request(f"input: {e}", "input") from e
            raise
        return PreparedRequest(route, request, response_id, int(time.time()),
                               self.model_name if lora is None else str(request.model),
                               engine_requests, output_parser)

    # ---- /tokenize and /detokenize (vLLM's) -----------------------------------------------
    def tokenize(self, body: Any) -> dict[str, Any]:
        chat = isinstance(body, dict) and "messages" in body
        request: Any = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        self._check_model(request.model)
        if chat:
            tokens = self._apply_chat_template(request)["prompt_token_ids"]
        else:
            try:
                check_text(request.prompt)
            except InvalidRequestError as e:
                raise bad_request(str(e), "prompt") from e
            tokens = list(self.engine.tokenizer(
                request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
        strs = (self.engine.tokenizer.convert_ids_to_tokens(tokens)
                if request.return_token_strs else None)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len,
                                tokens=tokens, token_strs=strs).model_dump()

    def detokenize(self, body: Any) -> dict[str, Any]:
        request = _parse(DetokenizeRequest, body)
        self._check_model(request.model)
        vocab = self.engine.model_config.vocab_size
        bad = sorted({t for t in request.tokens if not 0 <= t < vocab})
        if bad:
            raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab}).",
                              "tokens")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(request.tokens)).model_dump()

    async def run(self, prepared: PreparedRequest
                  ) -> dict[str, Any] | AsyncGenerator[str, None]:
        request = prepared.request
        self._admit(prepared.engine_requests,
                    "input" if isinstance(request, EmbeddingRequest) else "n")
        try:
            streams = await self._open(prepared.engine_requests)
        except BaseException:
            self._release(prepared.engine_requests)
            raise
        if not isinstance(request, EmbeddingRequest) and request.stream:
            return self._stream(prepared, streams)
        try:
            finals = await _gather_all([_last(first, it) for first, it in streams])
        except Exception as e:  # not CancelledError: a gone client's cancel must propagate
            raise from_exception(e) from e
        finally:
            self._release(prepared.engine_requests)
        if isinstance(request, EmbeddingRequest):
            return embedding_response(request, prepared.model, _pooled(finals),
                                      [len(f.prompt_token_ids) for f in finals])
        return openai_responses.full_response(prepared, finals, self.engine.tokenizer)

    # ---- validation ----------------------------------------------------------------------
    def _check_model(self, model: str | None) -> LoRARequest | None:
        """404 unless ``model`` is this model or one of its LoRA adapters (returned)."""
        if model is None or model == self.model_name:
            return None
        if self.loras is not None:
            return self.loras.resolve(model)
        raise not_found(f"The model `{model}` does not exist.", "model")

    def _apply_chat_template(self, request: ChatCompletionRequest | TokenizeChatRequest
                             ) -> dict[str, Any]:
        """The rendered conversation (with its tools), tokenized once (by the template's
        renderer)."""
        try:
            text, token_ids = apply_chat_template(
                self.engine.tokenizer, request.conversation(),
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
                tools=request.tool_definitions())
        except ValueError as e:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise bad_request(str(e), param) from e
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _sampling_params(self, request: Any, num_prompt_tokens: int) -> SamplingParams:
        """The request's params for a prompt of that length. An unset max_tokens is the
        room the prompt leaves (at least 1: a prompt that leaves none is the intake's to
        report). An embedding's are one token and the server's pooling."""
        default_max_tokens = max(1, self.max_model_len - num_prompt_tokens)
        try:
            if isinstance(request, EmbeddingRequest):
                return request.to_sampling_params(self.pooling_type)
            return request.to_sampling_params(default_max_tokens=default_max_tokens)
        except ValueError as e:
            raise bad_request(str(e), _field_of(e, request)) from e

    # ---- running -------------------------------------------------------------------------
    def _admit(self, engine_requests: list[EngineRequest], param: str = "n") -> None:
        """Count the requests' sequences in, or refuse them (``param``: the field that asks
        for them: n, or an embedding's input)."""
        limit, wanted = self.max_pending_requests, sum(r.inputs.params.n for r in engine_requests)
        if limit is not None and wanted > limit:  # would never fit: not a retry-later case
            what = "prompts x n" if param == "n" else f"one per {param}"
            raise bad_request(f"this request needs {wanted} sequences ({what}), more than "
                              f"the {limit} this server admits at once.", param)
        if limit is not None and self.num_pending + wanted > limit:
            raise overloaded(
                f"The server is overloaded: {self.num_pending} sequences in flight and this "
                f"request adds {wanted}, at most {limit} allowed. Retry later.")
        self._pending.update((r.request_id, r.inputs.params.n) for r in engine_requests)

    def _release(self, engine_requests: list[EngineRequest]) -> None:
        for r in engine_requests:
            self._pending.pop(r.request_id, None)

    async def _generate(self, req: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        timer = self.metrics.request_timer()
        finished = False
        try:
            # Closing the engine's stream before its last output is what aborts the request
            # (the engine client owns that abort).
            async with aclosing(self.engine.generate(req.inputs, req.request_id)) as it:
                async for out in it:
                    if out.error:
                        raise EngineDeadError(out.error)
                    timer.on_output(out)
                    finished = out.finished
                    yield out
                    if finished:
                        return
        finally:
            self._pending.pop(req.request_id, None)
            if not finished:
                timer.on_abort()

    async def _open(self, engine_requests: list[EngineRequest]) -> openai_responses.Streams:
        """Start every engine request and await its first output (errors surface here)."""
        iterators = [self._generate(r) for r in engine_requests]
        try:
            firsts = await _gather_all([anext(it) for it in iterators])
        except BaseException as e:
            await _aclose_all(iterators)
            if not isinstance(e, Exception) or isinstance(e, OpenAIError):
                raise  # CancelledError (the client went away) and the like propagate
            raise from_exception(e) from e
        return list(zip(firsts, iterators, strict=True))

    async def _stream(self, prepared: PreparedRequest, streams: openai_responses.Streams
                      ) -> AsyncGenerator[str, None]:
        try:
            lines = openai_responses.sse_lines(prepared, streams, self.engine.tokenizer)
            async with aclosing(lines):
                async for line in lines:
                    yield line
        finally:
            self._release(prepared.engine_requests)
            await _aclose_all([it for _, it in streams])


async def _aclose_all(iterators: list[AsyncGenerator[RequestOutput, None]]) -> None:
    """Close every iterator (each aborts its request if unfinished), even when a close is
    cancelled mid-way; then re-raise the first exception (a CancelledError included)."""
    error: BaseException | None = None
    for it in iterators:
        try:
            await it.aclose()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


async def _gather_all(awaitables: list[Any]) -> list[Any]:
    """Await them all at once; when one fails (or the caller is cancelled: the client went
    away), cancel the others, wait for them (each aborts its engine request), re-raise."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _pooled(finals: list[RequestOutput]) -> list[list[float]]:
    """Each embedding request's vector (the engine's to give: a 500 without one)."""
    vectors = []
    for f in finals:
        if f.pooled is None:
            reason = f.outputs[0].finish_reason if f.outputs else None
            raise OpenAIError(f"the engine returned no embedding for {f.request_id} "
                              f"(finish reason {reason!r}).", 500)
        vectors.append(f.pooled)
    return vectors


async def _last(first: RequestOutput, it: AsyncGenerator[RequestOutput, None]
                ) -> RequestOutput:
    last = first
    async with aclosing(it):
        async for out in it:
            last = out
    return last


def _field_of(error: ValueError, request: Any) -> str | None:
    """The request field a ValueError's message starts with (SamplingParams' messages do)."""
    field = str(error).split(" ", 1)[0].split(".", 1)[0]
    return field if field in type(request).model_fields else None


_M = TypeVar("_M", bound=BaseModel)


def _parse(model: type[_M], body: Any) -> _M:
    if isinstance(body, model):
        return body
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = pydantic_message(e)
        raise bad_request(message, param) from e
