"""EngineCore: the schedule -> execute -> update loop against the Executor protocol.

Two loops, picked by config (``step_fn``): ``step`` (one step in flight; the device idles
while the CPU updates and schedules) and ``step_with_batch_queue`` (up to
``max_concurrent_batches`` steps in flight; the CPU plans step t+1 while step t runs and
applies results one step late). Hazards of the overlap, where they are handled:

- an abort racing a step: aborts are queued by any thread and applied only at two points
  of the loop thread, before each schedule and before each result is applied; the
  scheduler then skips the aborted request's in-flight results (§3 rule 5);
- blocks of a finished request still written by an in-flight step: freed behind the
  step fence (KVCacheManager);
- a failed step: every request is finished with ABORT and EngineDeadError is raised;
- a grammar-constrained request scheduled while its previous token is in flight (rule 7):
  its step's forward is launched at once, but its sampling (``sample_tokens`` with the
  grammar bitmask) is sent only after the previous step's result has advanced the
  grammar; no step is scheduled meanwhile (``_deferred``). With speculative decoding the
  bitmask also needs the drafts that step's forward placed: its ``execute_model`` result
  (DraftTokenIds) is awaited first, so the grammar can cut them before verification.

Threading: ``add_request`` and the step functions run on one thread (the engine loop);
``abort_requests`` and ``get_metrics`` may be called from any thread.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Any

from raylm.scheduler.async_scheduler import AsyncScheduler
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.executor_base import EngineDeadError, Executor
from raylm.scheduler.core_outputs import (
    DraftTokenIds,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from raylm.scheduler.request import Request, RequestStatus
from raylm.scheduler.scheduler import Scheduler
from raylm.scheduler.scheduler_stats import device_info_key, metrics_dict
from raylm.scheduler.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# Consecutive schedules that produced nothing with nothing in flight before the engine
# declares the scheduler stuck (a liveness bug) instead of spinning.
_MAX_IDLE_EMPTY_STEPS = 3


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        if config.async_scheduling and not executor.supports_async_scheduling:
            logger.warning("async_scheduling is on but the executor blocks in execute_model: "
                           "results stay correct, steps will not overlap.")
        self.config = config
        self.executor = executor
        self.num_kv_blocks = self._init_kv_cache()
        self.device_info = executor.device_info()
        scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler: Scheduler = scheduler_cls(config, self.num_kv_blocks)
        self.scheduler.structured_output_manager = structured_output_manager
        self.batch_queue_size = config.max_concurrent_batches
        # A deferred step's future is None until its sampling is sent.
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput] | None, SchedulerOutput]] = (
            deque())
        # The deferred step, with its execute_model future (speculative decoding: the
        # drafts its bitmask needs).
        self._deferred: tuple[SchedulerOutput, Future[Any]] | None = None
        self.step_fn = self.step if self.batch_queue_size == 1 else self.step_with_batch_queue
        # Empty steps still advance the PP ring on the workers, so they are sent there.
        self._send_empty_steps = config.parallel_config.pipeline_parallel_size > 1
        self._abort_queue: deque[list[str]] = deque()  # appends are thread-safe
        self._pending_outputs: list[EngineCoreOutput] = []
        self._dead: BaseException | None = None
        self._num_idle_empty_steps = 0

    def _init_kv_cache(self) -> int:
        num_blocks = self.executor.determine_num_kv_blocks()
        # An explicit pool size (tests force preemption with it) caps what fits.
        explicit = self.config.cache_config.num_kv_blocks
        if explicit is not None:
            num_blocks = min(num_blocks, explicit)
        self.executor.initialize_kv_cache(num_blocks)
        return num_blocks

    # ---- requests ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Raises ValueError when the request can never be served. Loop thread only."""
        self._check_alive()
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Thread-safe: applied before the next schedule or result, whichever comes first.
        Each aborted request gets exactly one final output, with finish_reason ABORT."""
        self._abort_queue.append(list(request_ids))

    def _process_aborts(self) -> None:
        while self._abort_queue:
            ids = self._abort_queue.popleft()
            self._pending_outputs.extend(
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))

    # ---- the loops -----------------------------------------------------------------
    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """Synchronous: schedule, execute, wait, update."""
        self._check_alive()
        self._process_aborts()
        if not self.scheduler.has_requests():
            return self._take_pending(), False
        scheduler_output = self._schedule()
        if not self._should_execute(scheduler_output):
            return self._take_pending(), False
        future = self._execute(scheduler_output)
        assert not scheduler_output.pending_structured_output_tokens, (
            f"step {scheduler_output.step_id}: no token can be in flight in the synchronous loop")
        if scheduler_output.structured_output_request_ids:
            future = self._sample_tokens(scheduler_output, future)
        outputs = self._process_result(future, scheduler_output)
        return outputs, not scheduler_output.is_empty

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs | None, bool]:
        """Overlapped: keep up to batch_queue_size steps in flight, block on the oldest
        only when the queue is full or nothing more can be scheduled."""
        self._check_alive()
        self._process_aborts()
        executed = False
        queue = self.batch_queue
        if (self._deferred is None and self.scheduler.has_requests()
                and len(queue) < self.batch_queue_size):
            scheduler_output = self._schedule()
            if self._should_execute(scheduler_output):
                executed_future = self._execute(scheduler_output)
                future: Future[ModelRunnerOutput] | None = executed_future
                if scheduler_output.pending_structured_output_tokens:
                    # Rule 7: the forward runs now; the sampling waits for the grammar to
                    # see the token still in flight.
                    self._deferred, future = (scheduler_output, executed_future), None
                elif scheduler_output.structured_output_request_ids:
                    future = self._sample_tokens(scheduler_output, executed_future)
                queue.append((future, scheduler_output))
                executed = not scheduler_output.is_empty
                if self._deferred is None and len(queue) < self.batch_queue_size and (
                        executed or self.scheduler.has_requests()):
                    # Room for another step and more to plan: don't wait on the device.
                    return self._take_pending_or_none(), executed
        if not queue:
            return self._take_pending_or_none(), executed
        future, scheduler_output = queue.popleft()
        assert future is not None, (
            f"deferred step {scheduler_output.step_id} reached the head of the batch queue "
            "before the steps its grammar waits for")
        outputs = self._process_result(future, scheduler_output)
        if self._deferred is not None and self.scheduler.structured_output_ready(
                self._deferred[0]):
            deferred, executed_future = self._deferred
            assert queue and queue[-1][1] is deferred, "the deferred step is the newest"
            queue[-1] = (self._sample_tokens(deferred, executed_future), deferred)
            self._deferred = None
        return outputs, executed

    def _schedule(self) -> SchedulerOutput:
        self._pending_outputs.extend(self.scheduler.admit_structured_output_requests())
        scheduler_output = self.scheduler.schedule()
        self.scheduler.mark_structured_output(scheduler_output)
        return scheduler_output

    def _sample_tokens(self, scheduler_output: SchedulerOutput,
                       executed_future: Future[Any]) -> Future[ModelRunnerOutput]:
        """Send the grammar bitmask of a step whose forward was sent (``executed_future``:
        its execute_model's); the future of its sampling."""
        try:
            drafts = None
            if self.scheduler.needs_draft_token_ids(scheduler_output):
                # The worker proposed the drafts; their check needs them back (the forward
                # has run by then: only the sampling waits).
                placed = executed_future.result()
                assert isinstance(placed, DraftTokenIds), (
                    f"step {scheduler_output.step_id}: execute_model returned "
                    f"{type(placed).__name__}, not the drafts of its constrained requests")
                drafts = dict(zip(placed.req_ids, placed.draft_token_ids, strict=True))
            grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output, drafts)
            result = self.executor.sample_tokens(grammar_output, non_block=True)
        except Exception as e:
            raise self._fail(e) from e
        if isinstance(result, ModelRunnerOutput):
            done: Future[ModelRunnerOutput] = Future()
            done.set_result(result)
            return done
        return result

    def _should_execute(self, scheduler_output: SchedulerOutput) -> bool:
        if (not scheduler_output.is_empty or scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids or self._send_empty_steps):
            self._num_idle_empty_steps = 0
            return True
        # Nothing to run: with steps in flight, their results will change that.
        if self.scheduler.waiting_for_fsm and not self.batch_queue:
            # Grammars compiling and nothing else to do: wait a little, don't spin.
            self.scheduler.wait_for_grammars(timeout=0.01)
            return False
        if not self.batch_queue and self.scheduler.has_unfinished_requests():
            self._num_idle_empty_steps += 1
            if self._num_idle_empty_steps > _MAX_IDLE_EMPTY_STEPS:
                raise RuntimeError(
                    f"scheduler made no progress with nothing in flight: "
                    f"running={self.scheduler.running} waiting={list(self.scheduler.waiting)} "
                    f"free_blocks={self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()}")
        return False

    def _execute(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        try:
            result = self.executor.execute_model(scheduler_output, non_block=True)
        except Exception as e:
            raise self._fail(e) from e
        if isinstance(result, ModelRunnerOutput):  # an executor that cannot overlap
            done: Future[ModelRunnerOutput] = Future()
            done.set_result(result)
            return done
        return result

    def _process_result(self, future: Future[ModelRunnerOutput],
                        scheduler_output: SchedulerOutput) -> EngineCoreOutputs:
        try:
            model_output = future.result()
        except Exception as e:
            raise self._fail(e) from e
        self._process_aborts()  # an abort that raced this step wins over its tokens
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self._pending_outputs:
            outputs.outputs[:0] = self._pending_outputs
            self._pending_outputs = []
        if not self.batch_queue and not self.scheduler.has_unfinished_requests():
            self.scheduler.check_integrity(no_steps_in_flight=True)
        return outputs

    def _take_pending(self) -> EngineCoreOutputs:
        outputs, self._pending_outputs = self._pending_outputs, []
        return EngineCoreOutputs(outputs=outputs)

    def _take_pending_or_none(self) -> EngineCoreOutputs | None:
        return self._take_pending() if self._pending_outputs else None

    # ---- failure -------------------------------------------------------------------
    def _fail(self, cause: BaseException) -> EngineDeadError:
        """Finish every request with ABORT; the caller raises the returned EngineDeadError.

        The final ABORT outputs (with any not yet returned) ride on the exception as
        ``.outputs``, their only copy: whoever catches it delivers them.
        """
        self._dead = cause
        self.batch_queue.clear()
        self._deferred = None
        self._process_aborts()
        outputs = self._pending_outputs + self.scheduler.finish_requests(
            list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        self._pending_outputs = []
        error = EngineDeadError(f"EngineCore is dead: a step failed: {cause!r}")
        error.outputs = EngineCoreOutputs(outputs=outputs)  # type: ignore[attr-defined]
        logger.error("%s", error)
        return error

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"EngineCore is dead: a step failed: {self._dead!r}")

    # ---- queries -------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._abort_queue or self._pending_outputs or self.batch_queue
                    or self.scheduler.has_requests())

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[EngineCoreOutput]:
        """Step until nothing is left; every output in order (tests and offline use)."""
        outputs: list[EngineCoreOutput] = []
        for _ in range(max_steps):
            if not self.has_work():
                return outputs
            step_outputs, _ = self.step_fn()
            if step_outputs is not None:
                outputs.extend(step_outputs.outputs)
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def get_metrics(self) -> dict[str, Any]:
        s = self.scheduler
        kv = s.kv_cache_manager
        metrics = metrics_dict(
            s.counters, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_running=len(s.running),
            num_waiting=len(s.waiting), kv_cache_usage=kv.usage)
        if s.num_spec_tokens:
            metrics.update(s.spec_decode_counters.metrics())
        metrics[device_info_key(self.device_info)] = float(self.device_info.get("count", 1))
        return metrics

    def shutdown(self) -> None:
        self.batch_queue.clear()
        self.executor.shutdown()
        if self.scheduler.structured_output_manager is not None:
            self.scheduler.structured_output_manager.shutdown()
