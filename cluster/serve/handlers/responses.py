"""Turn the engine's cumulative RequestOutputs into OpenAI responses and SSE chunks.

Completions number their choices ``prompt_index * n + output.index`` (as OpenAI and vLLM).
Streaming sends deltas: the text and tokens each choice gained since its previous chunk.
A chat choice's text goes through its ``ChatOutputParser`` (reasoning, tool calls), in one
piece for a whole response and chunk by chunk for a stream; a choice that called tools
and stopped on its own ends with ``finish_reason`` "tool_calls".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from raylm.cluster.engine.outputs import CompletionOutput, RequestOutput
from raylm.cluster.serve.openai_api.chat_protocol import ChatCompletionRequest, ToolCall
from raylm.cluster.serve.openai_api.embedding_protocol import EmbeddingRequest
from raylm.cluster.serve.openai_api.errors import from_exception
from raylm.cluster.serve.openai_api.prepared import CHAT_COMPLETIONS, PreparedRequest
from raylm.cluster.serve.openai_api.protocol import CompletionRequest
from raylm.cluster.serve.openai_api.response_protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
)
from raylm.cluster.serve.tools.tool_parsers import ChatOutputParser, merge_deltas

DONE = "data: [DONE]\n\n"
Streams = list[tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]]


def sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


class _Format:
    """What differs between completions and chat, for one prepared request."""

    def __init__(self, prepared: PreparedRequest, tokenizer: Any):
        self.p = prepared
        req = prepared.request
        assert not isinstance(req, EmbeddingRequest)  # embeddings are answered elsewhere
        self.req = req
        self.chat = prepared.kind == CHAT_COMPLETIONS
        # The completions request (None for chat): echo and the legacy logprobs.
        self.completion = req if isinstance(req, CompletionRequest) else None
        self.tokenizer = tokenizer
        self.top_n: int
        if isinstance(req, ChatCompletionRequest):
            self.top_n, self.wants_logprobs = req.top_logprobs or 0, req.logprobs
        else:  # top_n is read only when logprobs are wanted
            self.top_n, self.wants_logprobs = req.logprobs or 0, req.logprobs is not None

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def parser(self) -> ChatOutputParser:
        factory = self.p.output_parser
        return factory() if factory is not None else ChatOutputParser()

    def echo_text(self, prompt_index: int) -> str:
        if self.completion is None or not self.completion.echo:
            return ""
        inputs = self.p.engine_requests[prompt_index].inputs
        if inputs.prompt is not None:
            return inputs.prompt
        return self.tokenizer.decode(inputs.prompt_token_ids)

    @property
    def scoring(self) -> bool:
        """echo + max_tokens=0: the response holds the prompt only."""
        return self.completion is not None and self.completion.echo_without_generation

    def logprobs(self, c: CompletionOutput, start: int, offset: int,
                 prompt: RequestOutput | None = None):
        """The logprobs of ``c``'s tokens from ``start``; with ``prompt`` (echo), those of
        the prompt's tokens first."""
        if not self.wants_logprobs or c.logprobs is None:
            return None
        ids, lps = c.token_ids[start:], c.logprobs[start:]
        if self.chat:
            return chat_logprobs(ids, lps, self.top_n, self.decode)
        out = None
        if prompt is not None and prompt.prompt_logprobs is not None:
            out = completion_logprobs(prompt.prompt_token_ids, prompt.prompt_logprobs,
                                      self.top_n, 0, self.decode)
            if self.scoring:
                return out
        return completion_logprobs(ids, lps, self.top_n, offset, self.decode, out)

    def usage(self, finals_tokens: int) -> UsageInfo:
        prompt = sum(len(r.inputs.prompt_token_ids) for r in self.p.engine_requests)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=finals_tokens,
                         total_tokens=prompt + finals_tokens)

    def response(self, choices: list[Any], usage: UsageInfo | None, chunk: bool
                 ) -> ChatCompletionResponse | CompletionResponse:
        p = self.p
        if self.chat:
            return ChatCompletionResponse(
                id=p.response_id, object="chat.completion.chunk" if chunk else "chat.completion",
                created=p.created, model=p.model, choices=choices, usage=usage)
        return CompletionResponse(id=p.response_id, created=p.created, model=p.model,
                                  choices=choices, usage=usage)


def full_response(prepared: PreparedRequest, finals: list[RequestOutput],
                  tokenizer: Any) -> dict[str, Any]:
    fmt = _Format(prepared, tokenizer)
    n, generated = fmt.req.n, 0
    choices: list[ChatCompletionResponseChoice | CompletionResponseChoice] = []
    for i, final in enumerate(finals):
        echo = fmt.echo_text(i)
        for c in sorted(final.outputs, key=lambda c: c.index):
            logprobs = fmt.logprobs(c, 0, len(echo), final if echo else None)
            if fmt.scoring:  # the one token the engine sampled is not part of the answer
                c = CompletionOutput(index=c.index, text="", token_ids=[],
                                     finish_reason="length")
            generated += len(c.token_ids)
            if fmt.chat:
                parser = fmt.parser()
                message = merge_deltas([parser.feed(c.text), parser.finish()])
                calls = [ToolCall.model_validate(call) for call in message["tool_calls"]]
                choices.append(ChatCompletionResponseChoice(
                    index=c.index, message=ChatResponseMessage(
                        content=message["content"] or (None if calls else ""),
                        reasoning_content=message["reasoning_content"], tool_calls=calls),
                    logprobs=logprobs, finish_reason=_finish_reason(c, parser),
                    stop_reason=c.stop_reason))
            else:
                choices.append(CompletionResponseChoice(
                    index=i * n + c.index, text=echo + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return fmt.response(choices, fmt.usage(generated), chunk=False).model_dump(mode="json")


def _finish_reason(c: CompletionOutput, parser: ChatOutputParser) -> str | None:
    if parser.called and c.finish_reason == "stop":
        return "tool_calls"
    return c.finish_reason


def _join(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
    """Two stream deltas as one: texts joined, tool call fragments in order."""
    out = dict(a or {})
    for key, value in (b or {}).items():
        out[key] = out[key] + value if key in out else value
    return out


@dataclass
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    offset: int = 0  # characters already sent (echoed prompt included)
    started: bool = False
    done: bool = False
    parser: ChatOutputParser | None = None  # chat only


async def sse_lines(prepared: PreparedRequest, streams: Streams, tokenizer: Any
                    ) -> AsyncGenerator[str, None]:
    fmt = _Format(prepared, tokenizer)
    states: dict[int, _ChoiceState] = {}
    # Chat's role chunks (one per choice) travel in the same item as the first token, so
    # that no transport batching can put the first token behind them.
    head = ""
    if fmt.chat:
        head = "".join(sse(fmt.response([ChatCompletionStreamChoice(
            index=index, delta={"role": "assistant", "content": ""})], None, chunk=True))
            for index in range(fmt.req.n))
    try:
        async with aclosing(_merged(streams)) as merged:
            async for i, out in merged:
                lines = [sse(fmt.response([choice], None, chunk=True))
                         for c in sorted(out.outputs, key=lambda c: c.index)
                         if (choice := _delta_choice(fmt, states, i, c)) is not None]
                if lines:
                    yield head + "".join(lines)
                    head = ""
        if fmt.req.include_usage:
            generated = sum(st.num_tokens for st in states.values())
            yield head + sse(fmt.response([], fmt.usage(generated), chunk=True))
            head = ""
    except Exception as e:  # headers are gone: the error travels as an SSE event
        yield head + sse(from_exception(e).to_dict())
        head = ""
    yield head + DONE


def _delta_choice(fmt: _Format, states: dict[int, _ChoiceState], prompt_index: int,
                  c: CompletionOutput):
    """The chunk choice for what ``c`` gained since the last chunk, or None if nothing."""
    index = c.index if fmt.chat else prompt_index * fmt.req.n + c.index
    st = states.setdefault(index, _ChoiceState())
    if st.done:
        return None
    echo = "" if st.started else fmt.echo_text(prompt_index)
    st.started = True
    delta = echo + c.text[st.text_len:]
    new_tokens = len(c.token_ids) - st.num_tokens
    if not delta and new_tokens <= 0 and c.finish_reason is None:
        return None
    logprobs = fmt.logprobs(c, st.num_tokens, st.offset + len(echo)) if new_tokens > 0 else None
    st.text_len, st.num_tokens = max(st.text_len, len(c.text)), len(c.token_ids)
    st.offset += len(delta)
    st.done = c.finish_reason is not None
    if fmt.chat:
        if st.parser is None:
            st.parser = fmt.parser()
        parts = st.parser.feed(delta) if delta else None
        if st.done:
            parts = _join(parts, st.parser.finish())
        elif not parts and logprobs is None:
            return None  # all of it held back (perhaps the start of a tag)
        return ChatCompletionStreamChoice(
            index=index, delta=parts or {}, logprobs=logprobs,
            finish_reason=_finish_reason(c, st.parser), stop_reason=c.stop_reason)
    return CompletionResponseChoice(index=index, text=delta, logprobs=logprobs,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)


async def _merged(streams: Streams) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several engine requests as they come, tagged with the prompt index."""
    for i, (first, _) in enumerate(streams):
        yield i, first
    if len(streams) == 1:  # the common case: no queue hop, no extra task
        async with aclosing(streams[0][1]) as it:
            async for out in it:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, (_, it) in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
