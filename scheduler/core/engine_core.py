"""EngineCore: the schedule -> execute -> update loop against the Executor protocol.

Two loops, picked by config (``step_fn``): ``step`` keeps one step in flight;
``step_with_batch_queue`` keeps up to ``max_concurrent_batches`` (its ``BatchQueue``), so
the CPU plans step t+1 while step t runs and applies results one step late
(docs/architecture.md §3). Aborts from any thread are queued and applied on the loop thread
only, before a schedule or a result (§3 rule 5); a failed step aborts every request.
Threading: ``abort_requests``, ``release_kv`` and ``get_metrics`` may be called from any
thread.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Any

from raylm.scheduler.async_scheduler import AsyncScheduler
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.batch_queue import BatchQueue, InFlightStep, StepState
from raylm.scheduler.core.executor_base import EngineDeadError, Executor
from raylm.scheduler.core_outputs import (
    DraftTokenIds,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from raylm.scheduler.diffusion_scheduler import DiffusionAsyncScheduler, DiffusionScheduler
from raylm.scheduler.expert_load_stats import expert_load_metrics
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
        scheduler_cls: type[Scheduler]
        if config.model_config.is_diffusion:  # its own ledger (docs/architecture.md §23)
            scheduler_cls = (DiffusionAsyncScheduler if config.async_scheduling
                             else DiffusionScheduler)
        else:
            scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler: Scheduler = scheduler_cls(config, self.num_kv_blocks,
                                                  structured_output_manager)
        self.structured_output = self.scheduler.structured_output  # grammars (rule 7)
        self.batch_queue_size = config.max_concurrent_batches
        self.batch_queue = BatchQueue(self.batch_queue_size)
        self.step_fn = self.step if self.batch_queue_size == 1 else self.step_with_batch_queue
        # Empty steps still advance the PP ring on the workers, so they are sent there.
        self._send_empty_steps = config.parallel_config.pipeline_parallel_size > 1
        self._abort_queue: deque[list[str]] = deque()  # appends are thread-safe
        self._release_queue: deque[list[str]] = deque()  # KV a peer has pulled
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
        max_len = self.config.model_config.max_model_len
        per_request = self.config.kv_blocks_per_request(max_len)
        windows = sorted({w for w in self.config.kv_cache_groups.windows if w is not None})
        groups = self.config.kv_cache_groups.num_groups
        logger.info("KV cache: %d blocks of %d tokens%s; a request of max_model_len=%d holds "
                    "at most %d of them%s: maximum concurrency %.2fx", num_blocks,
                    self.config.cache_config.block_size,
                    f" in {groups} groups of layers" if groups > 1 else "", max_len,
                    per_request,
                    f" (sliding window {windows}: blocks behind it are freed)" if windows
                    else "", num_blocks / per_request)
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

    def release_kv(self, request_ids: list[str]) -> None:
        """Thread-safe: a peer engine has pulled these finished requests' KV (prefill /
        decode disaggregation), so their held blocks may go back to the pool."""
        self._release_queue.append(list(request_ids))

    def _process_aborts(self) -> None:
        while self._abort_queue:
            ids = self._abort_queue.popleft()
            self._pending_outputs.extend(
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))
        while self._release_queue:
            self.scheduler.kv_transfer.release(self._release_queue.popleft())

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
        step = self._send(scheduler_output)
        assert step.state is not StepState.WAITING_FOR_BITMASK, (
            f"step {scheduler_output.step_id}: no token can be in flight in the synchronous loop")
        outputs = self._process_result(step)
        return outputs, not scheduler_output.is_empty

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs | None, bool]:
        """Overlapped: schedule and send while the queue has room and no step waits for
        its grammar; otherwise pop the oldest step, wait for its result and apply it, then
        send the sampling of a step whose grammar that result made ready."""
        self._check_alive()
        self._process_aborts()
        executed = False
        queue = self.batch_queue
        if (queue.waiting_for_bitmask() is None and self.scheduler.has_requests()
                and queue.has_room()):
            scheduler_output = self._schedule()
            if self._should_execute(scheduler_output):
                step = self._send(scheduler_output)
                queue.push(step)
                executed = not scheduler_output.is_empty
                if (step.state is not StepState.WAITING_FOR_BITMASK and queue.has_room()
                        and (executed or self.scheduler.has_requests())):
                    # Room for another step and more to plan: don't wait on the device.
                    return self._take_pending_or_none(), executed
        if not queue:
            return self._take_pending_or_none(), executed
        outputs = self._process_result(queue.pop_head())
        deferred = queue.waiting_for_bitmask()
        if deferred is not None and self.structured_output.structured_output_ready(
                deferred.scheduler_output):
            deferred.sampling_sent(self._sample_tokens(deferred))
        return outputs, executed

    def _schedule(self) -> SchedulerOutput:
        self._pending_outputs.extend(self.scheduler.admit_structured_output_requests())
        scheduler_output = self.scheduler.schedule()
        self.structured_output.mark_structured_output(scheduler_output)
        return scheduler_output

    def _send(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        """Send a step's forward and, unless its grammar must first see a token still in
        flight (§3 rule 7), its sampling."""
        step = InFlightStep(scheduler_output, self._execute(scheduler_output))
        if scheduler_output.pending_structured_output_tokens:
            step.state = StepState.WAITING_FOR_BITMASK
        elif scheduler_output.structured_output_request_ids:
            step.sampling_sent(self._sample_tokens(step))
        return step

    def _sample_tokens(self, step: InFlightStep) -> Future[ModelRunnerOutput]:
        """Send the grammar bitmask of a step whose forward was sent; the future of its
        sampling. With speculative decoding the bitmask also needs the drafts the forward
        placed (its execute_model result), so the grammar can cut them before verification."""
        scheduler_output = step.scheduler_output
        try:
            drafts = None
            if self.structured_output.needs_draft_token_ids(scheduler_output):
                # The forward has run by then: only the sampling waits.
                placed = step.forward_future.result()
                assert isinstance(placed, DraftTokenIds), (
                    f"step {scheduler_output.step_id}: execute_model returned "
                    f"{type(placed).__name__}, not the drafts of its constrained requests")
                drafts = dict(zip(placed.req_ids, placed.draft_token_ids, strict=True))
            grammar_output = self.structured_output.get_grammar_bitmask(scheduler_output,
                                                                        drafts)
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
                or scheduler_output.preempted_req_ids or self._send_empty_steps
                or scheduler_output.kv_connector_metadata is not None
                or self.scheduler.kv_transfer.has_pending_work()):
            self._num_idle_empty_steps = 0
            return True
        # Nothing to run: with steps in flight, their results will change that.
        if self.scheduler.waiting_for_fsm and not self.batch_queue:
            # Grammars compiling and nothing else to do: wait a little, don't spin.
            self.structured_output.wait_for_grammars(timeout=0.01)
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

    def _process_result(self, step: InFlightStep) -> EngineCoreOutputs:
        """Wait for a step's result (it has left the batch queue) and apply it."""
        scheduler_output = step.scheduler_output
        future = step.result_future
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
        self._process_aborts()
        outputs = self._pending_outputs + self.scheduler.finish_requests(
            list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        self._pending_outputs = []
        error = EngineDeadError(f"EngineCore is dead: a step failed: {cause!r}")
        error.outputs = EngineCoreOutputs(outputs=outputs)
        logger.error("%s", error)
        return error

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"EngineCore is dead: a step failed: {self._dead!r}")

    # ---- queries -------------------------------------------------------------------
    def has_work(self) -> bool:
        if self._release_queue:
            self._process_aborts()  # loop thread: a release needs no step
        self.scheduler.kv_transfer.free_expired()
        return bool(self._abort_queue or self._pending_outputs or self.batch_queue
                    or self.scheduler.has_requests())

    def get_metrics(self) -> dict[str, Any]:
        s = self.scheduler
        kv = s.kv_cache_manager
        metrics = metrics_dict(
            s.counters, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_running=len(s.running),
            num_waiting=len(s.waiting), kv_cache_usage=kv.usage)
        if s.num_spec_tokens:
            metrics.update(s.spec_decode_counters.metrics())
        metrics.update(s.kv_transfer.metrics())
        metrics.update(s.lora_metrics())
        metrics[device_info_key(self.device_info)] = float(self.device_info.get("count", 1))
        if self.config.model_config.num_experts:
            metrics.update(expert_load_metrics(self.executor.expert_load()))
        return metrics

    def shutdown(self) -> None:
        self.batch_queue.clear()
        self.executor.shutdown()
        if self.scheduler.structured_output_manager is not None:
            self.scheduler.structured_output_manager.shutdown()
