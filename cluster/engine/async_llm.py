"""AsyncLLM: the asyncio engine client the Serve deployment owns (implements EngineClient).

An output thread pulls engine outputs and hands each RequestOutput to the asyncio queue of
its request on the owning event loop. AsyncLLM owns its requests' aborts: closing a
``generate`` iterator early (the HTTP client went away) is the one abort the engine gets,
and the EngineCore then frees the request's KV blocks.
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
from raylm.cluster.engine.engine_stats import engine_stats
from raylm.cluster.engine.llm_engine import LLMEngine
from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import ValidatedPrompt
from raylm.scheduler.core.executor_base import EngineDeadError

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs,
                 model_resolver: Callable[[], str] | None = None) -> None:
        """``model_resolver``: see ``ModelConfig.model_resolver``."""
        self.engine = LLMEngine(engine_args, model_resolver)
        self.model_config = self.engine.model_config
        self.tokenizer = self.engine.tokenizer
        self.input_processor = self.engine.input_processor
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._queues_lock = threading.Lock()
        self.dead_error: BaseException | None = None
        self._running = True
        self._thread = threading.Thread(target=self._output_loop, name="raylm-output", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str, **engine_kwargs: Any) -> AsyncLLM:
        return cls(EngineArgs.from_kwargs(model, **engine_kwargs))

    @classmethod
    def from_llm_config(cls, llm_config: Any) -> AsyncLLM:
        """Build from a serving ``LLMConfig`` (raylm.cluster.serve.config)."""
        return cls(llm_config.engine_args(),
                   model_resolver=llm_config.model_loading_config.node_resolver())

    # -- the output thread -------------------------------------------------------------
    def _output_loop(self) -> None:
        while self._running:
            try:
                outputs = self.engine.step(timeout=0.2)
            except BaseException as e:  # engine dead: fail every open request once
                logger.error("raylm engine died: %r", e)
                self.dead_error = e
                self._fail_all(e)
                return
            if outputs:
                self._deliver([(out.request_id, out) for out in outputs])

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their requests' queues with one wake-up per event loop,
        not one per request: each ``call_soon_threadsafe`` writes the loop's self-pipe and
        costs the loop a turn."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._queues_lock:
            for request_id, item in items:
                entry = self._queues.get(request_id)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, error: BaseException) -> None:
        with self._queues_lock:
            ids = list(self._queues)
        self._deliver([(request_id, EngineDeadError(f"engine died: {error!r}"))
                       for request_id in ids])

    # -- EngineClient ------------------------------------------------------------------
    async def generate(self, prompt: ValidatedPrompt,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs; ``prompt`` comes from ``self.input_processor``.
        Closing the iterator before the last output (client gone, cancelled, failed) is
        what aborts the request: this is its one abort."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        q: asyncio.Queue = asyncio.Queue()
        with self._queues_lock:
            if request_id in self._queues:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            self._queues[request_id] = (asyncio.get_running_loop(), q)
        # Building the Requests is CPU work: off the event loop. Shielded, so that a cancel
        # never leaves the add running unseen in its thread (see the finally below).
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        added = loop.run_in_executor(None, functools.partial(
            context.run, self.engine.add_request, request_id, prompt))
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
            with self._queues_lock:
                self._queues.pop(request_id, None)
            if not finished:
                if added.done():
                    self._abort_if_added(request_id, added)
                else:  # cancelled while adding: abort once the add is in
                    added.add_done_callback(
                        functools.partial(self._abort_if_added, request_id))

    def _abort_if_added(self, request_id: str, added: asyncio.Future) -> None:
        """A failed ``add_request`` has let its request go already: nothing to abort."""
        if not added.cancelled() and added.exception() is None:
            self._abort_unfinished(request_id)

    def _abort_unfinished(self, request_id: str) -> None:
        """The abort of a stream closed before its last output. Never raises: it runs while
        another exception (a cancel, the engine's death) is on its way out."""
        try:
            self.engine.abort_request(request_id)
        except EngineDeadError as e:  # nothing left to free
            logger.debug("abort(%s) of an unfinished stream: %r", request_id, e)
        except Exception:
            logger.exception("abort(%s) of an unfinished stream failed", request_id)

    async def abort(self, request_id: str) -> None:
        """Abort by id; the request's stream ends with its final (aborted) output."""
        final = self.engine.abort_request(request_id)
        if final is not None:
            self._deliver([(request_id, final)])

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        await asyncio.to_thread(self.engine.check_health)

    def get_stats(self) -> dict[str, Any]:
        return engine_stats(self.engine.get_metrics())

    @property
    def num_kv_blocks(self) -> int | None:
        """The KV pool in blocks (every DP rank's); None while not known."""
        return self.engine.num_kv_blocks

    def shutdown(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self.engine.shutdown()


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
