"""A chat answer's text as OpenAI's message parts: content, reasoning_content, tool_calls.

``ChatOutputParser`` takes the text a choice gains, chunk by chunk (``feed``), then the end
(``finish``), and returns OpenAI delta dicts: ``{"content": ...}``,
``{"reasoning_content": ...}``, ``{"tool_calls": [{"index", "id", "type", "function":
{"name", "arguments"}}]}``. Streaming sends them as they come; a whole response merges
them (``merge_deltas``), so both forms are the same parse.

Where the calls come from depends on ``tool_choice`` (``ChatCompletionRequest.tool_mode``):

- ``named``: the grammar made the output the function's arguments object: one call, its
  header first, then the arguments as they stream.
- ``required``: the grammar made the output a JSON array of ``{"name", "arguments"}``
  objects: each call is sent once its element is complete.
- ``auto``: the model chose; a parser of vLLM's name finds the calls in its text:
  ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  with text around them) or ``llama3_json`` (an output that is a JSON object, or several
  separated by ``;``, with ``name`` and ``parameters``, optionally after
  ``<|python_tag|>``). Text that does not parse stays content.

A reasoning parser (``raylm.cluster.serve.tools.reasoning``) runs first; tools are parsed from
the answer after the reasoning.
"""

from __future__ import annotations

import json
from typing import Any

from raylm.cluster.serve.openai_api.protocol import random_id
from raylm.cluster.serve.tools.reasoning import Piece, ReasoningSplitter, partial_tag_length

TOOL_CALL_PARSERS = ("hermes", "llama3_json")

# A found call: ("call", name, arguments JSON text); ("args", text): more arguments of the
# named function's call; ("content", text).
Part = tuple[str, ...]


def _call(obj: Any, *arg_keys: str) -> Part | None:
    """A call from a decoded JSON object with a string ``name`` and an object of
    arguments under one of ``arg_keys`` (missing: no arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: object = next((obj[k] for k in arg_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return ("call", obj["name"], json.dumps(args, ensure_ascii=False))


class _Content:
    """No tools: everything is content."""

    def feed(self, text: str) -> list[Part]:
        return [("content", text)] if text else []

    def finish(self) -> list[Part]:
        return []


class _Named:
    """tool_choice names a function: the output is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[Part]:
        out: list[Part] = []
        if not self.started:
            self.started = True
            out.append(("call", self.name, ""))
        if text:
            out.append(("args", text))
        return out

    def finish(self) -> list[Part]:
        return [] if self.started else [("call", self.name, "")]


class _Required:
    """tool_choice "required": the output is a JSON array of calls; each is sent once its
    element has been decoded whole."""

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0  # where the next unread token starts
        self.state = "open"  # expecting "[", then "elem" or "sep" ("," or "]")
        self.found = 0
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Part]:
        self.buf += text
        out: list[Part] = []
        while True:
            rest = self.buf[self.pos:]
            stripped = rest.lstrip()
            skip = len(rest) - len(stripped)
            if not stripped:
                return out
            head = stripped[0]
            if self.state in ("open", "sep"):
                if head != ("[" if self.state == "open" else ","):
                    return out  # "]", or text no grammar made: finish() decides
                self.state, self.pos = "elem", self.pos + skip + 1
                continue
            if head == "]":
                return out
            try:
                obj, end = self._decoder.raw_decode(stripped)
            except json.JSONDecodeError:
                return out  # the element is not complete yet
            call = _call(obj, "arguments", "parameters")
            if call is None:
                return out
            out.append(call)
            self.found += 1
            self.state, self.pos = "sep", self.pos + skip + end

    def finish(self) -> list[Part]:
        if self.found:
            return []
        # Cut before its first element was complete (max_tokens): the text as it is.
        return [("content", self.buf)] if self.buf else []


class _Hermes:
    """``<tool_call>{json}</tool_call>`` anywhere in the text."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False

    def feed(self, text: str) -> list[Part]:
        self.buf += text
        out: list[Part] = []
        while True:
            if not self.in_call:
                at = self.buf.find(self.START)
                if at < 0:
                    keep = partial_tag_length(self.buf, self.START)
                    emit = self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    if emit:
                        out.append(("content", emit))
                    return out
                if at:
                    out.append(("content", self.buf[:at]))
                self.buf, self.in_call = self.buf[at + len(self.START):], True
            at = self.buf.find(self.END)
            if at < 0:
                return out
            out.append(self._parse(self.buf[:at]))
            self.buf, self.in_call = self.buf[at + len(self.END):], False

    def _parse(self, body: str) -> Part:
        try:
            call = _call(json.loads(body), "arguments", "parameters")
        except json.JSONDecodeError:
            call = None
        return call or ("content", f"{self.START}{body}{self.END}")

    def finish(self) -> list[Part]:
        text, self.buf = self.buf, ""
        if not self.in_call:
            return [("content", text)] if text else []
        try:  # cut before its end tag: a whole JSON object is still a call
            call = _call(json.loads(text), "arguments", "parameters")
        except json.JSONDecodeError:
            call = None
        return [call or ("content", self.START + text)]


class _Llama3Json:
    """An output that is a JSON call (or several joined by ``;``), perhaps after
    ``<|python_tag|>``; anything else is content. Decided on the first visible
    character; the calls are sent at the end."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "start"  # then "calls" or "content"

    def feed(self, text: str) -> list[Part]:
        if self.mode == "content":
            return [("content", text)] if text else []
        self.buf += text
        if self.mode == "start":
            head = self.buf.lstrip()
            if not head or self.TAG.startswith(head):
                return []
            self.mode = "calls" if head.startswith(("{", self.TAG)) else "content"
            if self.mode == "content":
                text, self.buf = self.buf, ""
                return [("content", text)]
        return []

    def finish(self) -> list[Part]:
        text, self.buf = self.buf, ""
        if self.mode != "calls":
            return [("content", text)] if text else []
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):]
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
            if pos == len(body):
                break
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return [("content", text)]
            call = _call(obj, "parameters", "arguments")
            if call is None:
                return [("content", text)]
            calls.append(call)
        return calls or [("content", text)]


def _tool_parser(mode: str, named: str | None, parser: str | None) -> Any:
    if mode == "named":
        assert named is not None
        return _Named(named)
    if mode == "required":
        return _Required()
    if mode == "auto" and parser is not None:
        if parser == "hermes":
            return _Hermes()
        if parser == "llama3_json":
            return _Llama3Json()
        raise ValueError(f"tool_call_parser {parser!r} is unknown; choose one of "
                         f"{list(TOOL_CALL_PARSERS)}.")
    return _Content()


class ChatOutputParser:
    """One choice's parser: see the module docstring. ``parallel_tool_calls=False`` keeps
    the first call only (the grammar already allows just one in ``required``)."""

    def __init__(self, tool_mode: str = "none", named_function: str | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 parallel_tool_calls: bool = True) -> None:
        self._reasoning = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self._tools = _tool_parser(tool_mode, named_function, tool_call_parser)
        self._parallel = parallel_tool_calls
        self.num_calls = 0

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> dict[str, Any] | None:
        """The delta for ``text`` (None: nothing to send yet)."""
        return self._delta(self._split(self._reasoning.feed(text) if self._reasoning
                                       else [("content", text)], end=False))

    def finish(self) -> dict[str, Any] | None:
        """The delta of what was held back, at the end of the output."""
        pieces = self._reasoning.finish() if self._reasoning else []
        return self._delta(self._split(pieces, end=True))

    def _split(self, pieces: list[Piece], end: bool) -> list[Part]:
        parts: list[Part] = []
        for kind, text in pieces:
            if kind == "reasoning":
                parts.append(("reasoning", text))
            else:
                parts += self._tools.feed(text)
        if end:
            parts += self._tools.finish()
        return parts

    def _delta(self, parts: list[Part]) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        for part in parts:
            kind = part[0]
            if kind in ("content", "reasoning"):
                key = "content" if kind == "content" else "reasoning_content"
                delta[key] = delta.get(key, "") + part[1]
            elif kind == "call":
                if self.num_calls and not self._parallel:
                    continue
                delta.setdefault("tool_calls", []).append({
                    "index": self.num_calls, "id": random_id("chatcmpl-tool"),
                    "type": "function", "function": {"name": part[1], "arguments": part[2]}})
                self.num_calls += 1
            elif kind == "args":
                calls = delta.setdefault("tool_calls", [])
                if calls and calls[-1]["index"] == self.num_calls - 1:
                    calls[-1]["function"]["arguments"] += part[1]
                else:
                    calls.append({"index": self.num_calls - 1,
                                  "function": {"arguments": part[1]}})
        return delta or None


def merge_deltas(deltas: list[dict[str, Any] | None]) -> dict[str, Any]:
    """A whole message from its deltas: texts joined, each call's arguments joined."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}  # by the call's index
    for d in deltas:
        if not d:
            continue
        content.append(d.get("content", ""))
        reasoning.append(d.get("reasoning_content", ""))
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"id": c.get("id"), "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
            fn = c.get("function", {})
            call["function"]["name"] += fn.get("name", "")
            call["function"]["arguments"] += fn.get("arguments", "")
    return {"content": "".join(content), "reasoning_content": "".join(reasoning) or None,
            "tool_calls": [calls[i] for i in sorted(calls)]}
