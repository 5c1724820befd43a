"""AsyncLLM: the asyncio engine client the Serve deployment owns (implements EngineClient).

``LLMEngine``'s sibling over the same EngineCore client. One asyncio task, started on the
event loop of the first ``generate``, reads the engine's outputs, runs the output processor
and puts each RequestOutput on its request's queue: from the engine loop to a request's
stream the outputs change hands twice, into the engine's output stream (in process: the
EngineCore loop thread's ``EngineOutputStream``; on Ray: the EngineCore actor's, read back
by one long poll per rank) and into the request's queue. AsyncLLM owns its requests'
aborts: closing a ``generate`` iterator early (the HTTP client went away) is the one abort
the engine gets, and the EngineCore then frees the request's KV blocks (docs/architecture.md §17).

One event loop is the usual case (a Serve replica's). A request made on another running
loop (an app serving one engine from two servers) is served too: the output processor and
the request registry are under a lock, and its outputs reach its loop through
``call_soon_threadsafe``; when the output task's loop stops, the task moves to a loop that
still has requests waiting.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any

from raylm.cluster.engine.engine_args import EngineArgs
from raylm.cluster.engine.engine_setup import EngineClientBase
from raylm.cluster.engine.engine_stats import engine_stats
from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import ValidatedPrompt
from raylm.scheduler.core.executor_base import EngineDeadError

logger = logging.getLogger(__name__)


class AsyncLLM(EngineClientBase):
    def __init__(self, engine_args: EngineArgs,
                 model_resolver: Callable[[], str] | None = None) -> None:
        """``model_resolver``: see ``EngineClientBase``."""
        super().__init__(engine_args, model_resolver)
        # The output processor and the queues, each request's with the loop it awaits on.
        self._lock = threading.Lock()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, _Queue]] = {}
        self._output_task: asyncio.Task | None = None
        self._closed = False  # shut down: the output task moves nowhere
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, model: str, **engine_kwargs: Any) -> AsyncLLM:
        return cls(EngineArgs.from_kwargs(model, **engine_kwargs))

    @classmethod
    def from_llm_config(cls, llm_config: Any) -> AsyncLLM:
        """Build from a serving ``LLMConfig`` (raylm.cluster.serve.deployment.config)."""
        return cls(llm_config.engine_args(),
                   model_resolver=llm_config.model_loading_config.node_resolver())

    # -- the output task ---------------------------------------------------------------
    def _start_output_task(self) -> None:
        """On the running loop, unless the task runs on another loop that is running."""
        loop = asyncio.get_running_loop()
        task = self._output_task
        if task is not None and not task.done() and (
                task.get_loop() is loop or task.get_loop().is_running()):
            return
        self._output_task = loop.create_task(self._read_outputs(), name="raylm-output")

    async def _read_outputs(self) -> None:
        try:
            while True:
                batches = await self.core.get_output_async()
                to_abort: list[str] = []
                deliveries: list[tuple[str, RequestOutput | BaseException]] = []
                with self._lock:
                    for batch in batches:
                        outputs, stopped = self.output_processor.process_outputs(batch)
                        to_abort.extend(stopped)
                        deliveries.extend((out.request_id, out) for out in outputs)
                self._deliver(deliveries)
                if to_abort:  # stop strings the detokenizer found: the engine stops them
                    self.core.abort_requests(to_abort)
        except asyncio.CancelledError:
            self._hand_over()
            raise
        except BaseException as e:  # engine dead: fail every open request once
            logger.error("raylm engine died: %r", e)
            self.dead_error = e
            failure = e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"engine died: {e!r}")
            with self._lock:
                ids = list(self._queues)
            self._deliver([(request_id, failure) for request_id in ids])

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Each item onto its request's queue: directly on this loop, with one wake-up per
        other loop."""
        here = asyncio.get_running_loop()
        elsewhere: dict[asyncio.AbstractEventLoop, list[tuple[_Queue, Any]]] = {}
        with self._lock:
            for request_id, item in items:
                entry = self._queues.get(request_id)
                if entry is None:
                    continue
                loop, q = entry
                if loop is here:
                    q.put_nowait(item)
                else:
                    elsewhere.setdefault(loop, []).append((q, item))
        for loop, batch in elsewhere.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that loop has closed: nobody reads those queues
                pass

    def _hand_over(self) -> None:
        """The output task's loop is shutting down: restart the task on a loop that still
        has requests waiting, if any."""
        here = asyncio.get_running_loop()
        self._output_task = None
        if self._closed:
            return
        with self._lock:
            loops = {loop for loop, _ in self._queues.values() if loop is not here}
        for loop in loops:
            try:
                loop.call_soon_threadsafe(self._start_output_task)
                return
            except RuntimeError:  # closed
                continue

    # -- EngineClient ------------------------------------------------------------------
    async def generate(self, prompt: ValidatedPrompt,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs; ``prompt`` comes from ``self.input_processor``.
        Closing the iterator before the last output (client gone, cancelled, failed) is
        what aborts the request: this is its one abort."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        q: _Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            self._queues[request_id] = (asyncio.get_running_loop(), q)
        self._start_output_task()
        # Shielded, so that a cancel never leaves the add running unseen (the finally).
        added = asyncio.ensure_future(self._add_request(request_id, prompt))
        finished = False
        try:
            await asyncio.shield(added)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
            if not finished:
                if added.done():
                    self._abort_if_added(request_id, added)
                else:  # cancelled while adding: abort once the add is in
                    added.add_done_callback(
                        functools.partial(self._abort_if_added, request_id))

    async def _add_request(self, request_id: str, prompt: ValidatedPrompt) -> None:
        # Building the Requests (block hashes of the prompt) is CPU work: off the loop.
        loop = asyncio.get_running_loop()
        parent, requests = await loop.run_in_executor(None, functools.partial(
            contextvars.copy_context().run, self.input_processor.make_requests,
            request_id, prompt))
        with self._lock:
            self.output_processor.add_request(parent, [r.request_id for r in requests])
        try:
            for r in requests:
                await self.core.add_request_async(r)
        except BaseException:
            self._abort_unfinished(request_id)
            raise

    def _abort_if_added(self, request_id: str, added: asyncio.Future) -> None:
        """A failed add has let its request go already: nothing to abort."""
        if not added.cancelled() and added.exception() is None:
            self._abort_unfinished(request_id)

    def _abort_unfinished(self, request_id: str) -> None:
        """The abort of a stream closed before its last output. Never raises: it runs while
        another exception (a cancel, the engine's death) is on its way out."""
        try:
            self._abort(request_id)
        except EngineDeadError as e:  # nothing left to free
            logger.debug("abort(%s) of an unfinished stream: %r", request_id, e)
        except Exception:
            logger.exception("abort(%s) of an unfinished stream failed", request_id)

    def _abort(self, request_id: str) -> RequestOutput | None:
        """The output processor lets the request go; the engine is told without waiting."""
        with self._lock:
            child_ids = self.output_processor.child_ids(request_id)
            final = self.output_processor.abort_request(request_id)
        if child_ids:
            self.core.abort_requests(child_ids)
        return final

    async def abort(self, request_id: str) -> None:
        """Abort by id; the request's stream ends with its final (aborted) output."""
        final = self._abort(request_id)
        if final is not None:
            self._deliver([(request_id, final)])

    async def release_kv(self, request_ids: list[str]) -> None:
        """Prefill/decode: free finished requests' KV that no decode engine will pull."""
        await asyncio.to_thread(self.core.release_kv, list(request_ids))

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        await asyncio.to_thread(self.core.check_health)

    def get_stats(self) -> dict[str, Any]:
        return engine_stats(self.core.get_metrics())

    @property
    def num_kv_blocks(self) -> int | None:
        """The KV pool in blocks (every DP rank's); None while not known."""
        return self.core.num_kv_blocks

    def shutdown(self) -> None:
        self._closed = True
        task = self._output_task
        if task is not None and not task.done():
            try:
                task.get_loop().call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop has closed, and the task with it
                pass
        self.core.shutdown()


_Queue = asyncio.Queue  # of RequestOutput, or the exception that ends the stream


def _put_all(batch: list[tuple[_Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
