"""OpenAI's error envelope: every failure the HTTP API reports has this one shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``; ``type`` is the
name OpenAI's clients map to exception classes (``BadRequestError`` etc.). A 400 is the
client's fault and comes only from explicit checks: an ``OpenAIError`` from the server's, an
``InvalidRequestError`` from the intake's or the engine's admission. Anything else is the
server's fault: a 500 logged with its traceback (a ``ValueError`` from a bug included).
"""

from __future__ import annotations

import logging
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


def error_body(message: str, status_code: int = 400, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    return {"error": {
        "message": message,
        "type": err_type or _TYPES.get(status_code, HTTPStatus(status_code).phrase),
        "param": param,
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
