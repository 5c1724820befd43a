"""In-process Executor: one worker thread runs steps strictly in order, a second thread
waits for each step's output to reach the host and resolves its future.

So the worker thread starts step t+1 while step t's sampled ids are still being copied,
and the EngineCore thread schedules meanwhile (torch releases the GIL in its kernels).
Futures resolve in submission order because every result, failures included, passes
through the one output queue. Setup (model load, KV cache) runs on the worker thread too,
so all of the worker's torch calls come from one thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from raylm.parallel.expert_parallel import DPExpertGroup
from raylm.runner.async_output import AsyncModelRunnerOutput
from raylm.runner.worker import Worker
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import DraftTokenIds, ModelRunnerOutput, SchedulerOutput
from raylm.scheduler.structured.manager import GrammarOutput

_STOP = object()
_T = TypeVar("_T")


class _Failed:
    def __init__(self, error: EngineDeadError) -> None:
        self.error = error


class _Call:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args


class UniProcExecutor:
    supports_async_scheduling = True

    def __init__(self, engine_config: EngineConfig, worker: Worker | None = None,
                 num_threads: int | None = None, expect_cuda: bool = False,
                 local_rank: int = 0, ep_group: DPExpertGroup | None = None) -> None:
        """``expect_cuda``: the process holds a GPU (a Ray actor given one); ``ep_group``:
        experts spread over the DP ranks; see ``Worker.init_device``."""
        self.engine_config = engine_config
        self._dead: EngineDeadError | None = None
        self._lock = threading.Lock()
        self._steps: queue.Queue = queue.Queue()
        self._outputs: queue.Queue = queue.Queue()
        self._step_thread = threading.Thread(target=self._step_loop, name="raylm-worker",
                                             daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop,
                                               name="raylm-output", daemon=True)
        self._step_thread.start()
        self._output_thread.start()
        if worker is None:
            try:
                worker = self._on_step_thread(self._load_worker, engine_config, num_threads,
                                              expect_cuda, local_rank, ep_group)
            except BaseException:
                self._steps.put(_STOP)
                raise
        self.worker = worker

    @staticmethod
    def _load_worker(engine_config: EngineConfig, num_threads: int | None,
                     expect_cuda: bool, local_rank: int,
                     ep_group: DPExpertGroup | None) -> Worker:
        worker = Worker(engine_config, local_rank=local_rank)
        worker.init_device(num_threads=num_threads, expect_cuda=expect_cuda, ep_group=ep_group)
        worker.load_model()
        return worker

    def _on_step_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn`` on the step thread, in order with the steps. Every torch call of this
        worker happens on that one thread: on CPU, intra-op parallel regions issued from a
        second thread after another thread's (OpenMP keeps a team per calling thread) run
        slower (docs/performance.md)."""
        future: Future[_T] = Future()
        self._steps.put((_Call(fn, args), future))
        return future.result()

    # ---------------------------------------------------------------- Executor protocol
    def determine_num_kv_blocks(self) -> int:
        self.check_health()
        return self._on_step_thread(lambda: self.worker.determine_num_kv_blocks())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.check_health()
        self._on_step_thread(lambda: self.worker.initialize_kv_cache(num_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        self.check_health()
        future: Future[ModelRunnerOutput] = Future()
        self._steps.put((scheduler_output, future))
        return future if non_block else future.result()

    def sample_tokens(self, grammar_output: GrammarOutput, non_block: bool = False
                      ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Queued behind the step it samples, like any step: order is kept."""
        return self.execute_model(grammar_output, non_block)  # type: ignore[arg-type]

    def device_info(self) -> dict[str, Any]:
        return {**self.worker.device_info(), "count": 1}

    def execute_dummy_batch(self) -> None:
        """Queued behind the steps sent before it; returns once every peer joined it."""
        self.check_health()
        self._on_step_thread(self.worker.execute_dummy_batch)

    def expert_load(self) -> dict[int, dict[int, int]]:
        self.check_health()
        return self._on_step_thread(self.worker.expert_load)

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    def shutdown(self) -> None:
        self._steps.put(_STOP)
        self._step_thread.join(timeout=30)
        self._output_thread.join(timeout=30)
        self.worker.shutdown()

    # ---------------------------------------------------------------- threads
    def _mark_dead(self, error: BaseException) -> EngineDeadError:
        with self._lock:
            if self._dead is None:
                dead = EngineDeadError(f"worker step failed: {type(error).__name__}: {error}")
                dead.__cause__ = error
                self._dead = dead
                self.worker.mark_dead(error)
            return self._dead

    def _step_loop(self) -> None:
        while True:
            item = self._steps.get()
            if item is _STOP:
                self._outputs.put(_STOP)
                return
            message, future = item
            if isinstance(message, _Call):  # setup work, answered directly
                try:
                    future.set_result(message.fn(*message.args))
                except BaseException as e:  # noqa: BLE001 - raised in the caller
                    future.set_exception(e)
                continue
            if self._dead is not None:
                self._outputs.put((_Failed(self._dead), future))
                continue
            out: ModelRunnerOutput | AsyncModelRunnerOutput | DraftTokenIds | _Failed | None
            try:
                out = Worker.run(self.worker, message)
            except BaseException as e:  # noqa: BLE001 - any failure kills the engine
                out = _Failed(self._mark_dead(e))
            self._outputs.put((out, future))

    def _output_loop(self) -> None:
        while True:
            item = self._outputs.get()
            if item is _STOP:
                return
            out, future = item
            if not isinstance(out, _Failed) and isinstance(out, AsyncModelRunnerOutput):
                try:
                    out = out.get_output()
                except BaseException as e:  # noqa: BLE001
                    out = _Failed(self._mark_dead(e))
            if future.cancelled():
                continue
            if isinstance(out, _Failed):
                future.set_exception(out.error)
            else:
                future.set_result(out)
