"""OpenAI response schemas (completions, chat, models, tokenize), and logprobs in OpenAI's
shapes from raylm's outputs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import Field

from raylm.cluster.engine.outputs import Logprob, SampleLogprobs
from raylm.cluster.serve.openai_api.chat_protocol import ChatCompletionTool, ChatMessage, ToolCall
from raylm.cluster.serve.openai_api.protocol import OpenAIBaseModel, TokenId


class TokenizeCompletionRequest(OpenAIBaseModel):
    """vLLM's /tokenize body for a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    """vLLM's /tokenize body for a conversation, rendered as /v1/chat/completions does."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    return_token_strs: bool | None = False

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ---- responses ---------------------------------------------------------------------------

class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _Choice(OpenAIBaseModel):
    """What every choice carries beside its content: which one, and why it ended (None
    until it has)."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response(OpenAIBaseModel):
    """The fields of every completion response, in OpenAI's order (a subclass narrows
    ``object`` and ``choices``; a field it redeclares keeps its place here)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None


class CompletionResponseChoice(_Choice):
    text: str
    logprobs: CompletionLogProbs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with a reasoning parser (vLLM's field)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(_Choice):
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None


class ChatCompletionStreamChoice(_Choice):
    # Only the keys that changed: {"role": ...} first, then {"content": ...},
    # {"reasoning_content": ...} or {"tool_calls": [{"index", "id", "type", "function"}]}.
    delta: dict[str, Any]
    logprobs: ChatLogProbs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice] | list[ChatCompletionStreamChoice]


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "raylm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---- logprobs: engine format (one {token_id: Logprob} per token) to OpenAI's two formats ----

def _token_text(token_id: int, lp: Logprob | None, decode: Callable[[int], str]) -> str:
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode(token_id)


def _top(entries: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    ranked = [(t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= top_n]
    return sorted(ranked, key=lambda item: item[1].rank or 0)  # every rank here is set


def completion_logprobs(token_ids: list[int], logprobs: Sequence[dict[int, Logprob] | None],
                        top_n: int,
                        offset: int, decode: Callable[[int], str],
                        out: CompletionLogProbs | None = None) -> CompletionLogProbs:
    """Legacy completions format; ``offset`` is where the first token's text starts. A
    None entry (an echoed prompt's first token) has no logprob. Appends to ``out``."""
    out = out if out is not None else CompletionLogProbs()
    for token_id, entries in zip(token_ids, logprobs, strict=False):
        if entries is None:
            text = decode(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        sampled = entries.get(token_id)
        text = _token_text(token_id, sampled, decode)
        out.tokens.append(text)
        out.token_logprobs.append(sampled.logprob if sampled is not None else None)
        # Like vLLM, the sampled token is listed among the top ones even when outside the top-n.
        top = {_token_text(t, lp, decode): lp.logprob for t, lp in _top(entries, top_n)}
        if sampled is not None:
            top.setdefault(text, sampled.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, top_n: int,
                  decode: Callable[[int], str]) -> ChatLogProbs:
    content = []
    for token_id, entries in zip(token_ids, logprobs, strict=False):
        sampled = entries.get(token_id)
        text = _token_text(token_id, sampled, decode)
        top = []
        for t, lp in _top(entries, top_n):
            top_text = _token_text(t, lp, decode)
            top.append(ChatTopLogprob(token=top_text, logprob=max(lp.logprob, -9999.0),
                                      bytes=list(top_text.encode("utf-8", "replace"))))
        content.append(ChatTokenLogprob(
            token=text, logprob=max(sampled.logprob, -9999.0) if sampled else -9999.0,
            bytes=list(text.encode("utf-8", "replace")), top_logprobs=top))
    return ChatLogProbs(content=content)
