"""Drive an EngineCore from a background thread; the engine client's side of it.

``EngineCoreClient`` is what the engine client (raylm.cluster) talks to. Two
implementations: ``InprocEngineCoreClient`` here (EngineCore in this process, stepped by
a busy-loop thread) and ``raylm.actors.ray_engine_core_client.RayEngineCoreClient`` (the
EngineCore in a Ray actor that runs this same loop).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol

from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core.output_stream import EngineOutputStream
from raylm.scheduler.core_outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason

if TYPE_CHECKING:
    from raylm.scheduler.core.engine_core import EngineCore
    from raylm.scheduler.request import Request

logger = logging.getLogger(__name__)


class EngineCoreClient(Protocol):
    def add_request(self, request: Request) -> None:
        """Raises ValueError when the request can never be served."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """Queue the aborts without waiting for them (an event loop calls this)."""
        ...

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next batch of outputs, in order; None on timeout. Raises EngineDeadError
        once the outputs queued before the death are read."""
        ...

    async def get_output_async(self) -> list[EngineCoreOutputs]:
        """Every batch ready, in order, awaiting the first on the running event loop (the
        asyncio engine client's one reader). Raises EngineDeadError as ``get_output``."""
        ...

    async def add_request_async(self, request: Request) -> None:
        """``add_request`` without blocking the event loop."""
        ...

    def release_kv(self, request_ids: list[str]) -> None:
        """Prefill/decode: free finished requests' KV that no decode engine will pull."""
        ...

    def get_metrics(self) -> dict[str, Any]: ...

    @property
    def num_kv_blocks(self) -> int | None:
        """The KV pool in blocks (every DP rank's); None while not known."""
        ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


# ("add", (request, what its caller waits on, or None)).
_InboxItem = tuple[str, tuple["Request", Any]]


class _Inbox:
    """The FIFO of adds from other threads to the loop thread. It remembers which request
    ids it holds, so that an abort can tell an add the loop has not admitted yet."""

    def __init__(self) -> None:
        self._items: collections.deque[_InboxItem] = collections.deque()
        self.lock = threading.Lock()
        self.queued: collections.Counter[str] = collections.Counter()  # ids of queued adds

    def put(self, item: _InboxItem, check: Any = None) -> None:
        """Queue ``item``; ``check()`` (raising to refuse it) runs under the lock, so an
        add cannot slip in after the loop has drained the inbox for good."""
        request_id = _add_id(item)
        with self.lock:
            if check is not None:
                check()
            self._items.append(item)
            if request_id is not None:
                self.queued[request_id] += 1

    def take_all(self) -> list[_InboxItem]:
        """Everything queued (the caller holds ``lock``)."""
        items = list(self._items)
        self._items.clear()
        self.queued.clear()
        return items

    def get_nowait(self) -> _InboxItem:
        with self.lock:
            if not self._items:
                raise queue.Empty
            item = self._items.popleft()
            request_id = _add_id(item)
            if request_id is not None:
                self.queued[request_id] -= 1
                if not self.queued[request_id]:
                    del self.queued[request_id]
            return item


def _add_id(item: _InboxItem) -> str | None:
    kind, (request, _) = item
    return request.request_id if kind == "add" else None


class EngineCoreLoop:
    """Steps an EngineCore whenever it has work; sleeps on a condition otherwise.

    Adds arrive from other threads through the inbox; the loop thread is the only one that
    calls into the scheduler, so the scheduler itself needs no locks. Aborts go straight to
    the EngineCore's own abort queue (thread-safe, applied on the loop thread).
    """

    def __init__(self, engine_core: Any) -> None:
        self.engine_core = engine_core
        self._inbox = _Inbox()
        # Aborts of adds still in the inbox: sent right after their add is admitted.
        self._aborts_after_add: set[str] = set()
        self._wakeup = threading.Event()
        self.outputs = EngineOutputStream()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="raylm-engine-core", daemon=True)
        self._thread.start()

    def add_request(self, request: Request) -> None:
        """Queue a request without waiting for the loop thread (which admits new requests
        once per step: waiting here would let only one request join each step).

        The engine-state checks (id in use, KV pool, structured-output backend) run here
        too, in the caller's thread, so that the caller gets their ValueError at once."""
        self._check_alive()
        self.engine_core.scheduler.validate_request(request)
        self._inbox.put(("add", (request, None)), check=self._check_alive)
        self._wakeup.set()

    def abort_requests(self, request_ids: list[str]) -> None:
        """One hop to the EngineCore's abort queue. An abort must not overtake the add it
        cancels: one whose add is still in the inbox waits for that add's admission."""
        now = []
        with self._inbox.lock:
            for request_id in request_ids:
                if request_id in self._inbox.queued:
                    self._aborts_after_add.add(request_id)
                else:
                    now.append(request_id)
        if now:
            self.engine_core.abort_requests(now)
        self._wakeup.set()

    def release_kv(self, request_ids: list[str]) -> None:
        """A peer engine has pulled these finished requests' KV: free their blocks."""
        self.engine_core.release_kv(request_ids)
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"EngineCore died: {self.dead_error!r}") from self.dead_error

    def _drain_inbox(self) -> None:
        while True:
            try:
                _, (request, done) = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self.engine_core.add_request(request)
            except ValueError as e:
                self._send_abort_after_add(request)
                if done is not None:
                    done.put(e)
                    continue
                # Validated by the caller already; a race (an id reused meanwhile) lands
                # here. Finish it as aborted rather than leave its caller waiting.
                logger.warning("request %s rejected by the scheduler: %s", request.request_id, e)
                self.outputs.put(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    request.request_id, [], finish_reason=FinishReason.ABORT)]))
                continue
            self._send_abort_after_add(request)
            if done is not None:
                done.put(None)

    def _send_abort_after_add(self, request: Request) -> None:
        """Send the abort that waited for this add, once no add of its id is queued."""
        request_id = request.request_id
        with self._inbox.lock:
            if request_id not in self._aborts_after_add or request_id in self._inbox.queued:
                return
            self._aborts_after_add.discard(request_id)
        self.engine_core.abort_requests([request_id])

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
        (carried by EngineDeadError) and of those still waiting in the inbox, then the
        death for every later reader: every request hears one final output."""
        with self._inbox.lock:
            self.dead_error = error
            queued = self._inbox.take_all()
        final = error.outputs if isinstance(error, EngineDeadError) else None
        outputs = list(final.outputs) if final is not None else []
        for kind, (request, done) in queued:
            if kind != "add":
                continue
            if done is not None:  # its caller waits for the add: it hears the death
                done.put(EngineDeadError(f"EngineCore died: {error!r}"))
                continue
            outputs.append(EngineCoreOutput(request.request_id, [],
                                            finish_reason=FinishReason.ABORT))
        if outputs:
            self.outputs.put(EngineCoreOutputs(outputs=outputs))
        dead = EngineDeadError(f"EngineCore died: {error!r}")
        dead.__cause__ = error
        self.outputs.put_death(dead)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        return self.outputs.get(timeout)

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

    engine_core: EngineCore

    async def get_output_async(self) -> list[EngineCoreOutputs]:
        return await self.outputs.get_ready_async()

    async def add_request_async(self, request: Request) -> None:
        self.add_request(request)  # an inbox put: never blocks

    def get_metrics(self) -> dict[str, Any]:
        return self.engine_core.get_metrics()

    @property
    def num_kv_blocks(self) -> int:
        return self.engine_core.num_kv_blocks
