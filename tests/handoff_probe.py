"""Counts the queues and thread wake-ups one request's outputs pass through on their way
from the engine loop to the request's stream.

Installed in a process (the test's, or an EngineCore actor's through ``__ray_call__``), it
wraps every conduit an output can take between threads or tasks: ``queue.Queue.put``,
``asyncio.Queue.put_nowait`` (``put`` goes through it), ``call_soon_threadsafe``,
``run_in_executor`` and the engine's own ``EngineOutputStream.put``. A call whose arguments
carry an output of the watched request (an EngineCoreOutputs, an EngineCoreOutput or a
RequestOutput with its id, inside lists, tuples, dicts or partials) counts one pass through
that conduit, named by its type and identity: the number of distinct conduits is the
number of handoffs.
"""

from __future__ import annotations

import asyncio
import asyncio.base_events
import collections
import functools
import queue
import threading
from typing import Any

from raylm.scheduler.core.output_stream import EngineOutputStream

_DEPTH = 5


class HandoffProbe:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.passes: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> HandoffProbe:
        self._wrap(queue.Queue, "put", lambda q, item, *a, **k: (f"queue.Queue@{id(q)}", item))
        self._wrap(asyncio.Queue, "put_nowait",
                   lambda q, item: (f"asyncio.Queue@{id(q)}", item))
        self._wrap(asyncio.base_events.BaseEventLoop, "call_soon_threadsafe",
                   lambda loop, cb, *args, **k: (f"call_soon_threadsafe({_name(cb)})",
                                                 (cb, args)))
        self._wrap(asyncio.base_events.BaseEventLoop, "run_in_executor",
                   lambda loop, ex, fn, *args: (f"run_in_executor({_name(fn)})", (fn, args)))
        self._wrap(EngineOutputStream, "put",
                   lambda s, batch: (f"EngineOutputStream@{id(s)}", batch))
        return self

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def _wrap(self, owner: Any, name: str, conduit_of: Any) -> None:
        original = getattr(owner, name)
        probe = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                conduit, payload = conduit_of(*args, **kwargs)
                if probe._carries(payload, _DEPTH):
                    with probe._lock:
                        probe.passes[conduit] += 1
            except Exception:  # noqa: BLE001 - a probe never breaks the call it watches
                pass
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)
        self._undo.append((owner, name, original))

    def _carries(self, obj: Any, depth: int) -> bool:
        if depth < 0:
            return False
        request_id = getattr(obj, "request_id", None)
        if isinstance(request_id, str) and (type(obj).__name__ in (
                "EngineCoreOutput", "RequestOutput")):
            return request_id == self.request_id
        if type(obj).__name__ == "EngineCoreOutputs":
            return any(self._carries(o, depth - 1) for o in obj.outputs)
        if isinstance(obj, functools.partial):
            return self._carries((obj.args, obj.keywords), depth - 1)
        if isinstance(obj, (list, tuple)):
            return any(self._carries(o, depth - 1) for o in obj)
        if isinstance(obj, dict):
            return any(self._carries(o, depth - 1) for o in obj.values())
        return False


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
