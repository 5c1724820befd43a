"""Calls to remote EngineCore actors whose failures turn into one EngineDeadError that
every later caller and reader sees (the driver-side Ray engine client's)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from typing import Any

import ray

from raylm.scheduler.core.executor_base import EngineDeadError

logger = logging.getLogger(__name__)


def submit(method: Any, *args: Any) -> Any:
    """``method.remote(*args)`` outside the calling Ray task's context. A Serve replica
    serves each request in a task of its own; when the client leaves, Serve cancels that
    task and Ray cancels, recursively, the tasks it submitted (an async actor's current task,
    a context variable, is the parent of what it submits). The engine's calls belong to the
    engine, not to a request: the abort of that very request, made as its stream closes,
    would be cancelled and read as the engine's death. Submitted from an empty context,
    they have no parent to be cancelled with."""
    return contextvars.Context().run(method.remote, *args)


def as_engine_dead(e: BaseException, who: str, what: str) -> EngineDeadError:
    """A Ray error from an EngineCore actor as the EngineDeadError the protocol promises."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, EngineDeadError):
        return EngineDeadError(str(cause))
    first = " ".join(str(e).split())[:600]
    return EngineDeadError(f"{who} failed during {what}: {first}")


class RemoteEngineCalls:
    """Mixin: the first death is kept and re-raised by every later call (and, once the
    outputs before it are read, by the reader)."""

    _who = "EngineCore actor"
    call_timeout_s: float

    def _init_death_tracking(self) -> None:
        self._dead: EngineDeadError | None = None
        self._dead_lock = threading.Lock()  # the reader and the callers may both see it

    def _call(self, ref: Any, what: str) -> Any:
        try:
            return ray.get(ref, timeout=self.call_timeout_s)
        except ray.exceptions.RayError as e:
            raise self._call_error(e, what) from None

    async def _call_async(self, ref: Any, what: str) -> Any:
        """``_call`` of one ref, awaited on the running event loop."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.call_timeout_s)
        except TimeoutError:
            error = EngineDeadError(f"{self._who} did not answer {what} within "
                                    f"{self.call_timeout_s:.0f} s")
            raise self._mark_dead(error) from None
        except ray.exceptions.RayError as e:
            raise self._call_error(e, what) from None

    def _call_error(self, e: ray.exceptions.RayError, what: str) -> Exception:
        if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, ValueError):
            return e.cause  # the caller's bad input, with its own type
        return self._mark_dead(as_engine_dead(e, self._who, what))  # died, or went silent

    def _mark_dead(self, error: EngineDeadError) -> EngineDeadError:
        with self._dead_lock:
            if self._dead is None:
                self._dead = error
                logger.error("Engine is dead: %s", error)
            return self._dead

    def _check_not_dead(self) -> None:
        if self._dead is not None:
            raise self._dead
