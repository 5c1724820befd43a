"""OpenAI chat requests: messages, tools and tool choice, and the chat completion request
(with vLLM's extras), which converts itself to SamplingParams like a completion."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from raylm.cluster.serve.openai_api.protocol import (
    Count,
    OpenAIBaseModel,
    _SamplingRequest,
    random_id,
)
from raylm.scheduler.sampling_params import SamplingParams
from raylm.scheduler.structured.params import StructuredOutputsParams


class ContentPart(OpenAIBaseModel):
    type: Literal["text"]  # images, audio and files are refused: raylm serves text only
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends and returns it


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments as a mapping when they are a JSON
        object (templates write them with ``tojson``), as vLLM hands them over."""
        arguments: Any = self.function.arguments
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (not rendered)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: _FunctionName


# The arguments of a function whose definition has no parameters schema: any object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM extra: the last message is continued
    chat_template: str | None = None  # a Jinja template replacing the model's (vLLM extra)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            if self.top_logprobs < 0:
                raise ValueError(f"top_logprobs must be non-negative, got {self.top_logprobs}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false (the "
                             "last message is continued, not answered)")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is "
                             f"not among tools {names}")
        if choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return self

    @property
    def tool_mode(self) -> str:
        """none (plain text), auto (the model may call; a parser finds the calls),
        required (a JSON array of calls, grammar-constrained) or named (one function's
        arguments, grammar-constrained). OpenAI's default: auto with tools, else none."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    @property
    def named_function(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (transformers' ``tools=``)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_call_constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes the output a valid call: for ``required`` a JSON array of
        ``{"name", "arguments"}`` objects, each the arguments of one function (one element
        at most without parallel_tool_calls); for a named function, its arguments."""
        mode = self.tool_mode
        functions = {t.function.name: t.function for t in self.tools or []}
        if mode == "named":
            name = self.named_function
            assert name is not None  # the "named" mode names one
            return StructuredOutputsParams(json=functions[name].parameters or _ANY_OBJECT)
        if mode != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": f.name},
                                 "arguments": f.parameters or _ANY_OBJECT},
                  "required": ["name", "arguments"]} for f in functions.values()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        tools = self.tool_call_constraint()
        own = super().structured_outputs_params()
        if tools is not None and own is not None:
            raise ValueError(f"tool_choice {self.tool_choice!r} constrains the output to a "
                             "tool call; it cannot be combined with response_format or "
                             "structured_outputs")
        return tools or own

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None),
                          default_max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)
