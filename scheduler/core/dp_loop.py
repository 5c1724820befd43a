"""The busy loop of one data-parallel rank: EngineCoreLoop plus waves (docs/architecture.md §5).

DP ranks step in *waves*. While any rank has work, every rank steps (a rank with nothing
of its own runs a dummy step), so models whose forward uses collectives across DP ranks
(MoE/EP) stay in lockstep. At the first step of a wave and every ``sync_interval`` steps
after it, each rank contributes ``[has_work, stop_requested, wave, -wave]`` to an
element-wise-max all-reduce. When no rank has work the wave ends, on every rank at the
same collective, and all ranks idle (no steps, no collectives) until a rank gets work
again: it starts the next wave itself and asks the coordinator to start it everywhere.

Why this stays in lockstep: each rank counts steps from 0 at the start of a wave and runs
the collective at the same counts, so the k-th collective of wave w is the same call on
every rank. A wave can end only through a collective every rank joined, so paused ranks
always agree on the next wave id; the ``wave``/``-wave`` slots check that on every call.

The loop thread is the only one that touches the EngineCore's scheduler or the all-reduce;
requests, aborts and start_wave messages come from other threads through queues.
Pure Python: the all-reduce is injected (``raylm.parallel.dp_sync`` gives the Gloo one;
tests pass an in-memory one).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from raylm.scheduler.config.validation import check_at_least, check_rank
from raylm.scheduler.core.engine_core_loop import EngineCoreLoop
from raylm.scheduler.core.executor_base import EngineDeadError

if TYPE_CHECKING:
    from raylm.scheduler.request import Request

logger = logging.getLogger(__name__)

#: ``all_reduce(values) -> values``: element-wise max over all DP ranks; bounded in time
#: (raises on timeout or a dead peer).
AllReduce = Callable[[list[int]], list[int]]

# Slots of the synced vector.
_HAS_WORK, _STOP, _WAVE, _NEG_WAVE = range(4)
_IDLE_WAIT_S = 0.5  # a paused rank re-checks its stop flag this often; wakeups are instant
_ADD_POLL_S = 0.5


@dataclass(frozen=True)
class WaveRecord:
    """What one finished wave cost on one rank; equal on every rank when in lockstep."""

    wave: int
    num_steps: int
    num_collectives: int


@dataclass
class DPLoopStats:
    dp_rank: int
    current_wave: int  # the wave this rank is in (running) or will start next (paused)
    running: bool
    num_waves_started: int = 0
    num_waves_completed: int = 0
    num_steps: int = 0  # loop iterations inside waves, dummy ones included
    num_dummy_steps: int = 0
    num_collectives: int = 0
    num_wave_start_requests: int = 0  # waves this rank started on its own work

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _AddSink:
    """Adapts the base loop's ``done.put(err)`` protocol to a Future."""

    def __init__(self) -> None:
        self.future: Future[None] = Future()

    def put(self, err: BaseException | None) -> None:
        if err is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(err)


class DPEngineCoreLoop(EngineCoreLoop):
    """EngineCoreLoop for DP rank ``dp_rank`` of ``dp_size``.

    ``request_start_wave(wave)`` tells the coordinator that this rank started ``wave`` on
    its own work (it must not block: it runs on the loop thread); the coordinator calls
    ``start_wave(wave)`` on the other ranks. ``on_wave_complete(wave)`` runs on the loop
    thread when a wave ends. ``execute_dummy_batch()`` runs whenever this rank did not run
    a forward in a wave step. ``shutdown()``: a paused rank leaves at once, a running one
    at its wave's next collective, whose stop slot makes every peer leave with it.
    """

    def __init__(
        self,
        engine_core: Any,
        *,
        dp_rank: int,
        dp_size: int,
        all_reduce: AllReduce,
        sync_interval: int = 16,
        request_start_wave: Callable[[int], None] | None = None,
        on_wave_complete: Callable[[int], None] | None = None,
        execute_dummy_batch: Callable[[], None] | None = None,
        wave_log_size: int = 1024,
    ) -> None:
        check_at_least("dp_size", dp_size)
        check_rank("dp_rank", dp_rank, dp_size)
        check_at_least("sync_interval", sync_interval)
        # Set before the base constructor: it starts the loop thread.
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.sync_interval = sync_interval
        self._all_reduce = all_reduce
        self._request_start_wave = request_start_wave or (lambda wave: None)
        self._on_wave_complete = on_wave_complete or (lambda wave: None)
        self._execute_dummy_batch = execute_dummy_batch or (lambda: None)
        self._start_wave_msgs: collections.deque[int] = collections.deque()  # appends are thread-safe
        self.stats = DPLoopStats(dp_rank=dp_rank, current_wave=0, running=False)
        self.wave_log: collections.deque[WaveRecord] = collections.deque(maxlen=wave_log_size)
        self._wave_steps = 0
        self._wave_collectives = 0
        super().__init__(engine_core)

    # ---- other threads -------------------------------------------------------------
    def add_request_async(self, request: Request) -> Future[None]:
        """Queue a request for the loop thread; the Future fails with ValueError for a
        request that can never be served. Never blocks."""
        self._check_loop_alive()
        sink = _AddSink()
        self._inbox.put(("add", (request, sink)), check=self._check_loop_alive)
        self._wakeup.set()
        return sink.future

    def add_request(self, request: Request) -> None:
        # Unlike the base loop, never wait forever: the loop thread may be dead or blocked
        # in a collective that is about to time out.
        future = self.add_request_async(request)
        while True:
            try:
                return future.result(timeout=_ADD_POLL_S)
            except TimeoutError:
                self._check_loop_alive()

    def start_wave(self, wave: int) -> None:
        """The coordinator says another rank started ``wave``: join it. Idempotent."""
        self._start_wave_msgs.append(wave)
        self._wakeup.set()

    def get_dp_stats(self) -> DPLoopStats:
        return DPLoopStats(**asdict(self.stats))

    def _check_loop_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"DP rank {self.dp_rank} EngineCore loop died: "
                                  f"{self.dead_error!r}") from self.dead_error
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError(f"DP rank {self.dp_rank} EngineCore loop is stopped.")

    # ---- the loop thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Clear before looking at the queues: a wakeup set after this line is seen
                # by the wait below, so nothing is missed while paused.
                self._wakeup.clear()
                self._drain_inbox()
                self._apply_start_wave_msgs()
                if not self.stats.running:
                    if self._stopped:
                        return  # paused ranks hold no collective: leaving is safe
                    if not self.engine_core.has_work():
                        self._wakeup.wait(timeout=_IDLE_WAIT_S)  # idle: no steps, no collectives
                        continue
                    # Paused with local work: a request that arrived after this rank
                    # contributed has_work=0 to the collective that ended the last wave, or
                    # while every rank was paused. Or an abort: has_work counts queued
                    # aborts, and only a step on this thread emits the ABORT output, so an
                    # abort reaching a paused rank starts a (short) wave too. Start the next
                    # wave here and ask the coordinator to start it on the other ranks,
                    # which are paused too (they ignore it if they already started it).
                    self.stats.num_wave_start_requests += 1
                    self._begin_wave(self.stats.current_wave)
                    self._request_start_wave(self.stats.current_wave)
                sync_due = self._wave_steps % self.sync_interval == 0
                self._step()
                if sync_due and self._sync():
                    return
        except BaseException as e:  # the rank is dead: every waiter must hear it once
            logger.error("DP rank %d EngineCore loop died: %r", self.dp_rank, e)
            self._die(e)

    def _apply_start_wave_msgs(self) -> None:
        while self._start_wave_msgs:
            wave = self._start_wave_msgs.popleft()
            current = self.stats.current_wave
            if wave < current:
                continue  # stale: that wave already ended here (all ranks ended it together)
            if wave > current:
                # Waves end only at collectives every rank joins, so paused ranks agree on
                # the next wave id; a higher one means the group lost lockstep.
                raise EngineDeadError(f"DP rank {self.dp_rank}: start_wave({wave}) is ahead "
                                      f"of this rank's wave {current}; the DP ranks lost lockstep.")
            if not self.stats.running:
                self._begin_wave(wave)
            # else: already in this wave (started on local work): the message is a duplicate.

    def _begin_wave(self, wave: int) -> None:
        assert wave == self.stats.current_wave, (wave, self.stats.current_wave)
        self.stats.running = True
        self.stats.num_waves_started += 1
        self._wave_steps = 0
        self._wave_collectives = 0

    def _step(self) -> None:
        executed = False
        if self.engine_core.has_work():
            outputs, executed = self.engine_core.step_fn()
            if outputs is not None and (outputs.outputs or outputs.scheduler_stats):
                self.outputs.put(outputs)
        if not executed:
            # No forward ran on this rank this step (no local work, or the step only
            # collected an in-flight result). A model with collectives across DP ranks in
            # its forward needs a dummy forward here; dense models make it a no-op.
            self._execute_dummy_batch()
            self.stats.num_dummy_steps += 1
        self.stats.num_steps += 1
        self._wave_steps += 1

    def _sync(self) -> bool:
        """Run the wave's collective; end the wave when no rank has work. True: stop now."""
        wave = self.stats.current_wave
        # has_work is read after the step and the inbox is not drained before the
        # collective: a request that lands now is not counted here; if this collective
        # ends the wave, the paused branch of _run starts the next one for it.
        local = [int(self.engine_core.has_work()), int(self._stopped), wave, -wave]
        self.stats.num_collectives += 1
        self._wave_collectives += 1
        try:
            result = self._all_reduce(local)
        except Exception as e:
            raise EngineDeadError(
                f"DP rank {self.dp_rank}/{self.dp_size}: wave {wave} sync all-reduce failed "
                f"(a peer rank is dead or stuck): {e!r}") from e
        if result[_WAVE] != wave or -result[_NEG_WAVE] != wave:
            raise EngineDeadError(
                f"DP rank {self.dp_rank}: ranks disagree on the wave in one collective "
                f"(here {wave}, min {-result[_NEG_WAVE]}, max {result[_WAVE]}); lost lockstep.")
        if result[_STOP]:
            # Some rank is shutting down; none can keep stepping in lockstep without it.
            self.stats.running = False
            if self._stopped:
                return True
            raise EngineDeadError(f"DP rank {self.dp_rank}: a peer DP rank shut down in wave {wave}.")
        if result[_HAS_WORK] == 0:
            self._end_wave(wave)
        return False

    def _end_wave(self, wave: int) -> None:
        self.wave_log.append(WaveRecord(wave, self._wave_steps, self._wave_collectives))
        self.stats.running = False
        self.stats.num_waves_completed += 1
        self.stats.current_wave = wave + 1
        self._on_wave_complete(wave)
