"""Drive an EngineCore from a background thread; the engine client's side of it.

``EngineCoreClient`` is what the engine client (raylm.cluster) talks to. Two
implementations: ``InprocEngineCoreClient`` here (EngineCore in this process, stepped by
a busy-loop thread) and ``raylm.actors.engine_core_client.RayEngineCoreClient`` (the
EngineCore in a Ray actor that runs this same loop).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol

from raylm.scheduler.executor import EngineDeadError
from raylm.scheduler.outputs import EngineCoreOutputs

if TYPE_CHECKING:
    from raylm.scheduler.request import Request

logger = logging.getLogger(__name__)


class EngineCoreClient(Protocol):
    def add_request(self, request: Request) -> None:
        """Raises ValueError when the request can never be served."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next batch of outputs, in order; None on timeout. Raises EngineDeadError."""
        ...

    def get_metrics(self) -> dict[str, Any]: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class EngineCoreLoop:
    """Steps an EngineCore whenever it has work; sleeps on a condition otherwise.

    Requests and aborts arrive from other threads; the loop thread is the only one that
    calls into the scheduler, so the scheduler itself needs no locks.
    """

    def __init__(self, engine_core: Any) -> None:
        self.engine_core = engine_core
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self.outputs: queue.Queue[EngineCoreOutputs | BaseException] = queue.Queue()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="raylm-engine-core", daemon=True)
        self._thread.start()

    def add_request(self, request: Request) -> None:
        done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._inbox.put(("add", (request, done)))
        self._wakeup.set()
        err = done.get()
        if err is not None:
            raise err

    def abort_requests(self, request_ids: list[str]) -> None:
        # EngineCore.abort_requests is thread-safe (queued, applied before each result).
        self.engine_core.abort_requests(list(request_ids))
        self._wakeup.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request, done = payload
                try:
                    self.engine_core.add_request(request)
                    done.put(None)
                except Exception as e:  # bad input is the caller's error, not the engine's
                    done.put(e)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine_core.has_work():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                outputs, _ = self.engine_core.step_fn()
                if outputs is not None and (outputs.outputs or outputs.scheduler_stats):
                    self.outputs.put(outputs)
        except BaseException as e:  # the engine is dead: every waiter must hear it once
            logger.error("EngineCore loop died: %r", e)
            self.dead_error = e
            self.outputs.put(e)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        try:
            item = self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self.outputs.put(item)  # keep it for the next reader
            raise EngineDeadError(f"EngineCore died: {item!r}") from item
        return item

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"EngineCore died: {self.dead_error!r}")
        self.engine_core.executor.check_health()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine_core.shutdown()


class InprocEngineCoreClient(EngineCoreLoop):
    """The EngineCore lives in this process; its loop runs in a daemon thread."""

    def get_metrics(self) -> dict[str, Any]:
        return self.engine_core.get_metrics()
