"""OpenAI Batch rows through one engine: what each ``raylm batch`` replica runs.

Input lines: ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}``. Output lines: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``. Rows go through the same ``OpenAIServing`` as the HTTP
server, so validation and responses are identical. A bad row is recorded (status 400 and its
error) and the run goes on. The run itself (Ray Data over replicas) is ``batch_job``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.errors import OpenAIError, from_exception
from raylm.cluster.serve.openai_api.prepared import CHAT_COMPLETIONS, COMPLETIONS
from raylm.cluster.serve.openai_api.protocol import random_id

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 256


def parse_row(line: str, line_no: int) -> tuple[str, str, dict[str, Any]]:
    """(custom_id, url, body) of one input line; raises OpenAIError(400) naming the line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise OpenAIError(f"line {line_no} is not valid JSON: {e}", 400) from e
    if not isinstance(row, dict):
        raise OpenAIError(f"line {line_no} must be a JSON object, got {type(row).__name__}.", 400)
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise OpenAIError(f"line {line_no}: custom_id must be a non-empty string (the key of the "
                          f"row in the output), got {custom_id!r}.", 400, "custom_id")
    if row.get("method", "POST") != "POST":
        raise OpenAIError(f"line {line_no}: method must be POST, got {row.get('method')!r}.", 400,
                          "method")
    url = row.get("url")
    if url not in (COMPLETIONS, CHAT_COMPLETIONS):
        raise OpenAIError(f"line {line_no}: url must be {COMPLETIONS!r} or {CHAT_COMPLETIONS!r}, "
                          f"got {url!r}.", 400, "url")
    body = row.get("body")
    if not isinstance(body, dict):
        raise OpenAIError(f"line {line_no}: body must be a JSON object, got {body!r}.", 400, "body")
    if body.get("stream"):
        raise OpenAIError(f"line {line_no}: stream is not supported in batch runs.", 400, "stream")
    return custom_id, url, body


def output_line(custom_id: Any, status: int, body: dict[str, Any], request_id: str) -> str:
    error = None
    if status != 200:
        err = body.get("error", {})
        error = {"code": err.get("type", str(status)), "message": err.get("message", "")}
    return json.dumps({
        "id": random_id("batch_req"), "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }) + "\n"


@dataclass(frozen=True)
class RowResult:
    """One row's output line, its HTTP status and how many tokens it generated."""

    text: str
    status: int
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200


class BatchRunner:
    """Runs rows through ``serving``; ``model_aliases`` are names rows may use for the model."""

    def __init__(self, serving: OpenAIServing, model_aliases: tuple[str, ...] = (),
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}.")
        self.serving = serving
        self.model_aliases = {serving.model_name, *model_aliases}
        self._limit = asyncio.Semaphore(max_concurrency)

    async def run_row(self, line: str, line_no: int) -> RowResult:
        request_id = random_id("batch")
        custom_id = None
        try:
            custom_id = input_custom_id(line)
            custom_id, url, body = parse_row(line, line_no)
            if body.get("model") is None or body.get("model") in self.model_aliases:
                body["model"] = self.serving.model_name
            async with self._limit:
                result = await self.serving.handle(url, body)
            assert isinstance(result, dict), "non-streaming calls return a response dict"
            tokens = int((result.get("usage") or {}).get("completion_tokens", 0))
            return RowResult(output_line(custom_id, 200, result, request_id), 200, tokens)
        except Exception as e:
            err = from_exception(e)
            return RowResult(output_line(custom_id, err.status_code, err.to_dict(), request_id),
                             err.status_code)

    async def run_rows(self, rows: list[tuple[int, str]]) -> list[RowResult]:
        """All ``(line_no, line)`` rows at once (at most ``max_concurrency`` in the engine),
        results in the order of ``rows``."""
        return list(await asyncio.gather(*(self.run_row(line, no) for no, line in rows)))

    async def engine_error(self) -> str | None:
        """Why the engine is dead, or None while it is healthy."""
        try:
            await self.serving.check_health()
        except Exception as e:
            return str(e) or type(e).__name__
        return None


def input_custom_id(line: str) -> Any:
    """The custom_id of an input line, None when the line is no JSON object."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row.get("custom_id") if isinstance(row, dict) else None


def reject_row(line: str, line_no: int) -> RowResult:
    """The 400 result of a row that names no usable custom_id (no engine needed)."""
    try:
        parse_row(line, line_no)
    except OpenAIError as err:
        return RowResult(output_line(input_custom_id(line), err.status_code, err.to_dict(),
                                     random_id("batch")), err.status_code)
    raise AssertionError(f"line {line_no} has a valid custom_id; it is no row to reject")
