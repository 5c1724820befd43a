"""Drive an EngineCore from a background thread; the engine client's side of it.

``EngineCoreClient`` is what the engine client (raylm.cluster) talks to. Two
implementations: ``InprocEngineCoreClient`` here (EngineCore in this process, stepped by
a busy-loop thread) and ``raylm.actors.ray_engine_core_client.RayEngineCoreClient`` (the
EngineCore in a Ray actor that runs this same loop).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol

from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason

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


def next_output(outputs: queue.Queue, timeout: float | None) -> Any:
    """The next item of an engine's output queue; None on timeout.

    Once the engine has died the last item is its EngineDeadError: it stays queued, so
    every later reader raises it too (with a fresh traceback, so that repeated reads do
    not grow one)."""
    try:
        item = outputs.get(timeout=timeout)
    except queue.Empty:
        return None
    if isinstance(item, EngineDeadError):
        outputs.put(item)  # keep it for the next reader
        raise item.with_traceback(None)
    return item


class EngineCoreLoop:
    """Steps an EngineCore whenever it has work; sleeps on a condition otherwise.

    Requests and aborts arrive from other threads; the loop thread is the only one that
    calls into the scheduler, so the scheduler itself needs no locks.
    """

    def __init__(self, engine_core: Any) -> None:
        self.engine_core = engine_core
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self.outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="raylm-engine-core", daemon=True)
        self._thread.start()

    def add_request(self, request: Request) -> None:
        """Queue a request without waiting for the loop thread (which admits new requests
        once per step: waiting here would let only one request join each step).

        Validation that can fail for bad input runs here, in the caller's thread, on state
        that never changes (pool size, max_model_len)."""
        self._check_alive()
        self.engine_core.scheduler.validate_request(request)
        self._inbox.put(("add", (request, None)))
        self._wakeup.set()

    def abort_requests(self, request_ids: list[str]) -> None:
        # Through the same FIFO as adds: an abort can never overtake the add it cancels.
        self._inbox.put(("abort", list(request_ids)))
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"EngineCore died: {self.dead_error!r}") from self.dead_error

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine_core.abort_requests(payload)
                continue
            request, done = payload
            try:
                self.engine_core.add_request(request)
            except ValueError as e:
                if done is not None:
                    done.put(e)
                    continue
                # Validated by the caller already; a race (an id reused meanwhile) lands
                # here. Finish it as aborted rather than leave its caller waiting.
                logger.warning("request %s rejected by the scheduler: %s", request.request_id, e)
                self.outputs.put(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    request.request_id, [], finish_reason=FinishReason.ABORT)]))
                continue
            if done is not None:
                done.put(None)

    def _run(self) -> None:
        try:
            while not self._stopped:
                # Clear before looking at the inbox: a wakeup set after this line is seen
                # by the wait below, so no request waits out the idle timeout.
                self._wakeup.clear()
                self._drain_inbox()
                if not self.engine_core.has_work():
                    self._wakeup.wait(timeout=0.5)
                    continue
                outputs, _ = self.engine_core.step_fn()
                if outputs is not None and (outputs.outputs or outputs.scheduler_stats):
                    self.outputs.put(outputs)
        except BaseException as e:  # the engine is dead: every waiter must hear it once
            logger.error("EngineCore loop died: %r", e)
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """Record the death; queue the ABORT outputs of the requests the EngineCore held
        (carried by EngineDeadError), then the death for every later reader."""
        self.dead_error = error
        final = getattr(error, "outputs", None)
        if isinstance(final, EngineCoreOutputs) and final.outputs:
            self.outputs.put(final)
        dead = EngineDeadError(f"EngineCore died: {error!r}")
        dead.__cause__ = error
        self.outputs.put(dead)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        return next_output(self.outputs, timeout)

    def check_health(self) -> None:
        self._check_alive()
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
