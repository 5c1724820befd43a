"""EngineOutputStream: the one ordered stream of an engine loop's outputs, its death last.

The engine loop thread puts each step's outputs here; one reader takes them, either by
blocking (the offline ``LLMEngine``, an EngineCore actor's long poll) or by awaiting on an
event loop (``AsyncLLM``'s output task, woken with ``call_soon_threadsafe``). This is the
one place that orders a failure after the outputs before it: ``put_death`` closes the
stream, readers take every batch queued before it, and then each read raises the death
(docs/architecture.md §17).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time

from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutputs


class EngineOutputStream:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._batches: collections.deque[EngineCoreOutputs] = collections.deque()
        self._death: EngineDeadError | None = None
        self._waiter: asyncio.Future | None = None  # an awaiting reader's, while it waits

    def put(self, batch: EngineCoreOutputs) -> None:
        """Queue one step's outputs (ignored once the stream has closed on a death)."""
        with self._cond:
            if self._death is not None:
                return
            self._batches.append(batch)
            self._cond.notify()
            waiter, self._waiter = self._waiter, None
        _wake(waiter)

    def put_death(self, error: EngineDeadError) -> None:
        """Close the stream: after the batches queued so far, every read raises ``error``.
        The first death is the one kept."""
        with self._cond:
            if self._death is None:
                self._death = error
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        _wake(waiter)

    @property
    def death(self) -> EngineDeadError | None:
        return self._death

    def get(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next batch, waiting up to ``timeout``; None on timeout."""
        with self._cond:
            if not self._wait_ready(timeout):
                return None
            if self._batches:
                return self._batches.popleft()
            raise self._raised()

    def get_ready(self, timeout: float | None = None) -> list[EngineCoreOutputs]:
        """Every batch queued, waiting up to ``timeout`` for the first; [] on timeout."""
        with self._cond:
            if not self._wait_ready(timeout):
                return []
            return self._take_all()

    async def get_ready_async(self) -> list[EngineCoreOutputs]:
        """Every batch queued, awaiting the first on the running event loop."""
        while True:
            with self._cond:
                if self._batches or self._death is not None:
                    return self._take_all()
                waiter = asyncio.get_running_loop().create_future()
                self._waiter = waiter
            try:
                await waiter
            finally:
                with self._cond:
                    if self._waiter is waiter:
                        self._waiter = None

    def _wait_ready(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._batches and self._death is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _take_all(self) -> list[EngineCoreOutputs]:
        """The caller holds the lock and something is there: the batches, or the death."""
        if not self._batches:
            raise self._raised()
        batches = list(self._batches)
        self._batches.clear()
        return batches

    def _raised(self) -> EngineDeadError:
        """The death, its traceback reset per read so that repeated reads do not grow one."""
        assert self._death is not None
        return self._death.with_traceback(None)


def _wake(waiter: asyncio.Future | None) -> None:
    if waiter is None:
        return
    try:
        waiter.get_loop().call_soon_threadsafe(_set_done, waiter)
    except RuntimeError:  # its event loop has closed: nobody is waiting any more
        pass


def _set_done(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
