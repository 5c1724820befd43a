"""``raylm batch``: run an OpenAI Batch file through the engine, all rows concurrently.

Input lines: ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}``. Output lines: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``, in input order. Rows go through the same ``OpenAIServing``
as the HTTP server, so validation and responses are identical. A bad row is recorded (status
400 and its error) and the run goes on; a dead engine fails the run (exit code 1).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from raylm.cluster.errors import OpenAIError, from_exception
from raylm.cluster.openai_protocol import random_id
from raylm.cluster.openai_serving import CHAT_COMPLETIONS, COMPLETIONS, OpenAIServing

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 256
EXIT_ENGINE_DEAD = 1


@dataclass
class BatchResult:
    num_rows: int
    num_errors: int
    engine_error: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_ENGINE_DEAD if self.engine_error else 0


def parse_row(line: str, line_no: int) -> tuple[str | None, str, dict[str, Any]]:
    """(custom_id, url, body) of one input line; raises OpenAIError(400) naming the line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise OpenAIError(f"line {line_no} is not valid JSON: {e}", 400) from e
    if not isinstance(row, dict):
        raise OpenAIError(f"line {line_no} must be a JSON object, got {type(row).__name__}.", 400)
    custom_id = row.get("custom_id")
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


class BatchRunner:
    """Runs rows through ``serving``; ``model_aliases`` are names rows may use for the model."""

    def __init__(self, serving: OpenAIServing, model_aliases: tuple[str, ...] = (),
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}.")
        self.serving = serving
        self.model_aliases = {serving.model_name, *model_aliases}
        self._limit = asyncio.Semaphore(max_concurrency)

    async def run_row(self, line: str, line_no: int) -> tuple[bool, str]:
        """(ok, output line) for one input line."""
        request_id = random_id("batch")
        custom_id = None
        try:
            custom_id = _custom_id(line)
            custom_id, url, body = parse_row(line, line_no)
            if body.get("model") is None or body.get("model") in self.model_aliases:
                body["model"] = self.serving.model_name
            async with self._limit:
                result = await self.serving.handle(url, body)
            assert isinstance(result, dict), "non-streaming calls return a response dict"
            return True, output_line(custom_id, 200, result, request_id)
        except Exception as e:
            err = from_exception(e)
            return False, output_line(custom_id, err.status_code, err.to_dict(), request_id)

    async def run(self, lines: list[str], out: TextIO, progress: bool = True) -> BatchResult:
        rows = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
        bar = _progress(len(rows)) if progress else None
        tasks = [asyncio.ensure_future(self.run_row(ln, no)) for no, ln in rows]
        errors = 0
        try:
            for task in tasks:  # write in input order; later rows keep running meanwhile
                ok, text = await task
                errors += not ok
                out.write(text)
                if bar is not None:
                    bar.update(1)
        finally:
            for task in tasks:
                task.cancel()
            if bar is not None:
                bar.close()
        out.flush()
        engine_error = None
        try:
            await self.serving.check_health()
        except Exception as e:
            engine_error = str(e) or type(e).__name__
        return BatchResult(len(rows), errors, engine_error)


def _custom_id(line: str) -> Any:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row.get("custom_id") if isinstance(row, dict) else None


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Batch", unit="req", file=sys.stderr, dynamic_ncols=True)


async def run_batch_file(engine: Any, input_path: str, output_path: str,
                         served_model_name: str | None = None,
                         model_aliases: tuple[str, ...] = (),
                         max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                         progress: bool = True) -> BatchResult:
    with open(input_path) as f:
        lines = f.read().splitlines()
    runner = BatchRunner(OpenAIServing(engine, served_model_name), model_aliases, max_concurrency)
    with open(output_path, "w") as out:
        result = await runner.run(lines, out, progress)
    logger.info("batch: %d rows, %d errors -> %s", result.num_rows, result.num_errors, output_path)
    return result
