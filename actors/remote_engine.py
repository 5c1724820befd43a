"""What the driver-side Ray engine clients share: calls to remote EngineCore actors whose
failures turn into one EngineDeadError that every later caller and reader sees."""

from __future__ import annotations

import contextvars
import logging
import queue
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
    """Mixin: ``self._outputs`` is the queue readers take outputs from; the first death
    is queued there once and re-raised by every later call."""

    _who = "EngineCore actor"
    call_timeout_s: float
    _outputs: queue.Queue

    def _init_death_tracking(self) -> None:
        self._dead: EngineDeadError | None = None
        self._dead_lock = threading.Lock()  # the pollers and the callers may both see it

    def _call(self, ref: Any, what: str) -> Any:
        try:
            return ray.get(ref, timeout=self.call_timeout_s)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ValueError):
                raise e.cause from None  # the caller's bad input, with its own type
            raise self._mark_dead(as_engine_dead(e, self._who, what)) from None
        except ray.exceptions.RayError as e:  # the actor died or stopped answering
            raise self._mark_dead(as_engine_dead(e, self._who, what)) from None

    def _mark_dead(self, error: EngineDeadError) -> EngineDeadError:
        with self._dead_lock:
            if self._dead is None:
                self._dead = error
                logger.error("Engine is dead: %s", error)
                self._outputs.put(error)
            return self._dead

    def _check_not_dead(self) -> None:
        if self._dead is not None:
            raise self._dead
