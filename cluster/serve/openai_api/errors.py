"""OpenAI's error envelope: every failure the HTTP API reports has this one shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``; ``type`` is the
name OpenAI's clients map to exception classes (``BadRequestError`` etc.). A 400 is the
client's fault and comes only from explicit checks: an ``OpenAIError`` from the server's, an
``InvalidRequestError`` from the intake's or the engine's admission. Anything else is the
server's fault: a 500 logged with its traceback (a ``ValueError`` from a bug included).

An error body never carries a stack trace or a file path: a message keeps its first line
only, paths in it become ``<path>``, and a 500 names the exception's type and first line
(the log has the rest).
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.request import InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """A failure the API reports to the client, with its HTTP status."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.param = param
        self.err_type = err_type or _TYPES.get(self.status_code, HTTPStatus(self.status_code).phrase)

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.status_code, self.param, self.err_type)


class EngineOverloadedError(RuntimeError):
    """Raised by a server (or an engine client) that has no room for one more request."""


# An absolute path of two or more parts (/usr/lib/..., C:\\x\\y), perhaps with :line. It
# is a file system's (and hidden) when it starts at a usual root or names a file with an
# extension; an API route (/v1/completions) is neither.
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.@+~-]+){2,}(?::\d+)?")
_FS_ROOTS = frozenset({"home", "usr", "tmp", "work", "opt", "root", "var", "etc", "mnt",
                       "srv", "lib", "lib64", "proc", "sys", "nix", "Users", "private", "app",
                       "data", "models", "workspace"})
_FILE = re.compile(r"\.[A-Za-z]\w{0,9}(?::\d+)?$")
_MAX_MESSAGE = 2000


def _hide_path(match: re.Match[str]) -> str:
    text = match.group(0)
    parts = [p for p in re.split(r"[/\\]", text) if p]
    root = parts[0].rstrip(":") if parts else ""
    if root in _FS_ROOTS or re.match(r"[A-Za-z]:$", root) or _FILE.search(text):
        return "<path>"
    return text


def safe_message(message: str) -> str:
    """``message`` fit for a client: its first line, no file paths, bounded length, valid
    UTF-8 (a lone surrogate from the request is replaced)."""
    lines = str(message).strip().splitlines()
    first = lines[0] if lines else ""
    first = _PATH.sub(_hide_path, first)[:_MAX_MESSAGE]
    return first.encode("utf-8", "replace").decode("utf-8")


def error_body(message: str, status_code: int = 400, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    return {"error": {
        "message": safe_message(message),
        "type": err_type or _TYPES.get(status_code, HTTPStatus(status_code).phrase),
        "param": None if param is None else safe_message(param),
        "code": status_code,
    }}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param)


def not_found(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 404, param)


def overloaded(message: str) -> OpenAIError:
    return OpenAIError(message, 503)


def from_exception(exc: Exception) -> OpenAIError:
    """Map an exception to what the client sees; a 500 is logged with its traceback."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    # Ray Serve's own queue limit (max_queued_requests of a deployment), matched by name so
    # this module never imports Ray.
    if isinstance(exc, EngineOverloadedError) or type(exc).__name__ == "BackPressureError":
        return overloaded(str(exc))
    if isinstance(exc, EngineDeadError):
        logger.error("request failed, the engine is dead: %s", exc)
        return OpenAIError(f"The engine is dead: {exc}", 500)
    logger.error("request failed with an internal error", exc_info=exc)
    return OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", 500)


def pydantic_message(exc: Any) -> tuple[str, str | None]:
    """Turn a pydantic ValidationError (or FastAPI's) into a message and the bad field."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return str(exc), None
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        field = ".".join(loc) or None
        param = param or field
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        parts.append(f"{field or 'request'}: {err.get('msg', 'invalid')}{shown}")
    return "; ".join(parts), param
