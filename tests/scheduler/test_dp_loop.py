"""DPEngineCoreLoop: waves, lockstep collectives, the wave-end races, idling, failures.

d loops run in threads, each over a fake EngineCore (a request is "N steps of work") or
the real EngineCore over the scheduler's FakeExecutor; the all-reduce is an in-memory
Barrier-based one that can run a hook while every rank is inside a collective (after all
contributed, before any saw the result) to inject the races exactly there.
"""

from __future__ import annotations

import collections
import functools
import random
import threading
import time
from types import SimpleNamespace

import pytest
from sched_fake_executor import FakeExecutor, expected_token, make_config, make_request

from raylm.scheduler.core import dp_loop as dp_loop_module
from raylm.scheduler.core.dp_loop import DPEngineCoreLoop, WaveRecord
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason

DEADLINE_S = 20.0  # only to turn a hang into a failure; nothing asserts on time


class FakeRequest:
    def __init__(self, request_id: str, num_steps: int) -> None:
        self.request_id = request_id
        self.num_steps = num_steps


class FakeEngineCore:
    """A request is ``num_steps`` steps of work; each step yields one token (its count)."""

    def __init__(self, step_time: float = 0.0) -> None:
        self.step_time = step_time
        self.remaining: dict[str, int] = {}
        self.done_steps: collections.Counter[str] = collections.Counter()
        self._aborts: collections.deque[list[str]] = collections.deque()
        self.num_step_calls = 0
        # A paused rank's loop asks has_work() once per wake-up (a message, or its idle
        # timeout): the positive event the idle tests wait for.
        self.num_has_work_calls = 0
        self.executor = SimpleNamespace(check_health=lambda: None)
        self.shut_down = False

    def add_request(self, request: FakeRequest) -> None:
        if request.num_steps < 1:
            raise ValueError(f"num_steps must be positive, got {request.num_steps}")
        self.remaining[request.request_id] = request.num_steps

    def abort_requests(self, request_ids: list[str]) -> None:
        self._aborts.append(list(request_ids))

    def has_work(self) -> bool:
        self.num_has_work_calls += 1
        return bool(self.remaining or self._aborts)

    def step_fn(self) -> tuple[EngineCoreOutputs, bool]:
        self.num_step_calls += 1
        outs = []
        while self._aborts:
            for rid in self._aborts.popleft():
                if self.remaining.pop(rid, None) is not None:
                    outs.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT))
        executed = bool(self.remaining)
        for rid in list(self.remaining):
            self.remaining[rid] -= 1
            self.done_steps[rid] += 1
            finished = self.remaining[rid] == 0
            if finished:
                del self.remaining[rid]
            outs.append(EngineCoreOutput(rid, [self.done_steps[rid]],
                                         finish_reason=FinishReason.LENGTH if finished else None))
        if self.step_time:
            time.sleep(self.step_time)
        return EngineCoreOutputs(outputs=outs), executed

    def shutdown(self) -> None:
        self.shut_down = True


class ThreadAllReduce:
    """Element-wise max over d threads. ``between(contributions)`` runs once per collective,
    by one thread, while every rank is inside it: after all contributed, before any result."""

    def __init__(self, size: int, timeout: float = 10.0) -> None:
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[list[int]] = [[] for _ in range(size)]
        self._result: list[int] = []
        self.calls = [0] * size
        self.between = None

    def for_rank(self, rank: int):
        def all_reduce(values: list[int]) -> list[int]:
            self.calls[rank] += 1
            self._slots[rank] = list(values)
            if self._barrier.wait() == 0:
                self._result = [max(col) for col in zip(*self._slots)]
                if self.between is not None:
                    self.between([list(s) for s in self._slots])
            self._barrier.wait()
            result = list(self._result)
            self._barrier.wait()  # nobody writes the next round before all read this one
            return result
        return all_reduce


class LoopGroup:
    """d DP loops and a coordinator that broadcasts start_wave (without deduplicating, so
    the ranks' own idempotence is what is tested)."""

    def __init__(self, d: int, interval: int, step_time: float = 0.0,
                 barrier_timeout: float = 10.0, coordinator: bool = True,
                 cores: list | None = None) -> None:
        self.ar = ThreadAllReduce(d, barrier_timeout)
        self.cores = cores or [FakeEngineCore(step_time) for _ in range(d)]
        self.coordinator_calls: list[tuple[int, int]] = []
        self.loops: list[DPEngineCoreLoop] = []
        for r in range(d):
            self.loops.append(DPEngineCoreLoop(
                self.cores[r], dp_rank=r, dp_size=d, all_reduce=self.ar.for_rank(r),
                sync_interval=interval,
                request_start_wave=functools.partial(self._start_wave, r) if coordinator else None))
        self.outputs: list[list[EngineCoreOutput]] = [[] for _ in range(d)]

    def _start_wave(self, from_rank: int, wave: int) -> None:
        self.coordinator_calls.append((from_rank, wave))
        for r, loop in enumerate(self.loops):
            if r != from_rank:
                loop.start_wave(wave)

    def collect_until_finished(self, request_ids) -> dict[str, list[EngineCoreOutput]]:
        want = set(request_ids)
        deadline = time.monotonic() + DEADLINE_S
        while want - self.finished_ids():
            assert time.monotonic() < deadline, f"unfinished: {sorted(want - self.finished_ids())}"
            for r, loop in enumerate(self.loops):
                out = loop.get_output(timeout=0.01)
                if out is not None:
                    self.outputs[r].extend(out.outputs)
        return self.by_request()

    def finished_ids(self) -> set[str]:
        return {o.request_id for outs in self.outputs for o in outs if o.finished}

    def by_request(self) -> dict[str, list[EngineCoreOutput]]:
        res: dict[str, list[EngineCoreOutput]] = collections.defaultdict(list)
        for outs in self.outputs:
            for o in outs:
                res[o.request_id].append(o)
        return res

    def wait_all_paused(self, num_waves: int | None = None) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            stats = [loop.get_dp_stats() for loop in self.loops]
            done = {s.num_waves_completed for s in stats}
            if not any(s.running for s in stats) and len(done) == 1 and (
                    num_waves is None or done == {num_waves}):
                return
            assert time.monotonic() < deadline, f"ranks not all paused: {stats}"
            time.sleep(0.01)

    def wait_idle_wakeups(self, n: int) -> None:
        """Until every rank's loop has woken ``n`` more times while paused. The wake-up in
        progress may have read its messages before this call; the one after it has not."""
        start = [c.num_has_work_calls for c in self.cores]
        deadline = time.monotonic() + DEADLINE_S
        while any(c.num_has_work_calls < s + n for c, s in zip(self.cores, start)):
            assert time.monotonic() < deadline, [c.num_has_work_calls for c in self.cores]
            time.sleep(0.01)

    def shutdown(self) -> None:
        for loop in self.loops:
            loop.shutdown()


@pytest.fixture
def groups():
    made: list[LoopGroup] = []

    def make(*args, **kwargs) -> LoopGroup:
        made.append(LoopGroup(*args, **kwargs))
        return made[-1]

    yield make
    for g in made:
        g.shutdown()


def test_one_request_is_one_wave_with_exact_counts(groups):
    g = groups(2, interval=4)
    g.loops[0].add_request(FakeRequest("a", 5))
    outs = g.collect_until_finished(["a"])
    g.wait_all_paused(num_waves=1)
    assert [o.new_token_ids for o in outs["a"]] == [[1], [2], [3], [4], [5]]
    assert outs["a"][-1].finish_reason == FinishReason.LENGTH
    # Collectives at wave steps 0 and 4; the 5th step finishes "a" and its collective ends
    # the wave on both ranks. Rank 1 had no work: every one of its steps was a dummy.
    expected = [WaveRecord(wave=0, num_steps=5, num_collectives=2)]
    assert [list(loop.wave_log) for loop in g.loops] == [expected, expected]
    s0, s1 = (loop.get_dp_stats() for loop in g.loops)
    assert (s0.num_dummy_steps, s1.num_dummy_steps) == (0, 5)
    assert (s0.num_wave_start_requests, s1.num_wave_start_requests) == (1, 0)
    assert g.coordinator_calls == [(0, 0)]
    assert g.ar.calls == [2, 2]
    assert s0.current_wave == s1.current_wave == 1


@pytest.mark.parametrize("d,interval", [(2, 1), (3, 3), (3, 16)])
def test_random_load_stays_in_lockstep_and_completes(groups, d, interval):
    g = groups(d, interval=interval, step_time=0.0005)
    rng = random.Random(d * 100 + interval)
    want: dict[str, int] = {}
    for burst in range(6):
        for i in range(rng.randint(1, 5)):
            rid = f"b{burst}-{i}"
            want[rid] = rng.randint(1, 25)
            g.loops[rng.randrange(d)].add_request(FakeRequest(rid, want[rid]))
        if burst % 2:
            g.wait_all_paused()  # the next burst arrives while every rank is paused
        else:
            time.sleep(rng.random() * 0.01)  # or mid-wave
    outs = g.collect_until_finished(want)
    g.wait_all_paused()
    for rid, n in want.items():
        assert [t for o in outs[rid] for t in o.new_token_ids] == list(range(1, n + 1)), rid
        assert sum(o.finished for o in outs[rid]) == 1
    logs = [list(loop.wave_log) for loop in g.loops]
    assert all(log == logs[0] for log in logs), logs
    assert len(logs[0]) >= 3  # the paused bursts each needed a new wave
    for rec in logs[0]:
        # Collectives fall at wave steps 0, k, 2k, ...; the last one ended the wave.
        assert rec.num_steps == (rec.num_collectives - 1) * interval + 1, rec
    assert len(set(g.ar.calls)) == 1, g.ar.calls
    assert [rec.wave for rec in logs[0]] == list(range(len(logs[0])))


def test_idle_ranks_do_not_spin(groups):
    g = groups(3, interval=2)
    g.loops[1].add_request(FakeRequest("x", 3))
    g.collect_until_finished(["x"])
    g.wait_all_paused(num_waves=1)
    before = ([loop.get_dp_stats() for loop in g.loops], list(g.ar.calls),
              [c.num_step_calls for c in g.cores])
    start = time.monotonic()
    calls = [c.num_has_work_calls for c in g.cores]
    # Two idle wake-ups on every rank: each was a chance to step or join a collective.
    g.wait_idle_wakeups(2)
    after = ([loop.get_dp_stats() for loop in g.loops], list(g.ar.calls),
             [c.num_step_calls for c in g.cores])
    assert before == after  # paused: no steps, no dummies, no collectives
    # And it sleeps between wake-ups: at most one per idle timeout (a busy box only makes
    # them rarer), plus the one in progress.
    bound = (time.monotonic() - start) / dp_loop_module._IDLE_WAIT_S + 2
    woke = [c.num_has_work_calls - n for c, n in zip(g.cores, calls)]
    assert all(w <= bound for w in woke), (woke, bound)


@pytest.mark.parametrize("inject_rank", [0, 1])
def test_request_arriving_between_contribution_and_wave_end_is_not_stranded(groups, inject_rank):
    g = groups(2, interval=1)
    injected = []

    def between(contributions):
        # Every rank has contributed has_work=0: this collective ends wave 0. The request
        # lands now, after the rank's contribution and before it sees the result.
        if not injected and all(c[0] == 0 for c in contributions):
            injected.append(g.loops[inject_rank].add_request_async(FakeRequest("late", 2)))

    g.ar.between = between
    g.loops[0].add_request(FakeRequest("early", 3))
    g.collect_until_finished(["early", "late"])
    g.wait_all_paused(num_waves=2)
    assert injected and injected[0].result(timeout=1) is None
    # Wave 0 ended with "late" in the inbox; its rank started wave 1 itself, and the
    # coordinator brought the other rank in.
    assert g.coordinator_calls == [(0, 0), (inject_rank, 1)]
    logs = [list(loop.wave_log) for loop in g.loops]
    assert logs[0] == logs[1] == [WaveRecord(0, 3, 3), WaveRecord(1, 2, 2)]
    assert [t for o in g.by_request()["late"] for t in o.new_token_ids] == [1, 2]


def test_request_while_all_ranks_paused_starts_a_wave_everywhere(groups):
    g = groups(3, interval=4)
    g.loops[0].add_request(FakeRequest("first", 2))
    g.collect_until_finished(["first"])
    g.wait_all_paused(num_waves=1)
    dummies = [loop.get_dp_stats().num_dummy_steps for loop in g.loops]
    g.loops[2].add_request(FakeRequest("second", 6))
    g.collect_until_finished(["second"])
    g.wait_all_paused(num_waves=2)
    assert g.coordinator_calls == [(0, 0), (2, 1)]
    stats = [loop.get_dp_stats() for loop in g.loops]
    assert [s.num_waves_started for s in stats] == [2, 2, 2]
    # Collectives at wave steps 0, 4 (one step of work left) and 8 (none): 9 steps.
    rec = WaveRecord(1, 9, 3)
    assert [loop.wave_log[-1] for loop in g.loops] == [rec, rec, rec]
    # Ranks 0 and 1 had nothing in wave 1: all nine of their steps were dummies; rank 2
    # ran dummies after its request finished, until the collective at step 8.
    assert [s.num_dummy_steps - d for s, d in zip(stats, dummies)] == [9, 9, 3]


def test_simultaneous_and_stale_start_wave_are_idempotent(groups):
    g = groups(3, interval=2)
    futures = [loop.add_request_async(FakeRequest(f"r{i}", 3 + i))
               for i, loop in enumerate(g.loops)]
    for f in futures:
        f.result(timeout=DEADLINE_S)
    g.collect_until_finished(["r0", "r1", "r2"])
    g.wait_all_paused(num_waves=1)
    assert {w for _, w in g.coordinator_calls} == {0}  # maybe several asked; one wave
    calls = list(g.ar.calls)
    for loop in g.loops:
        loop.start_wave(0)  # stale duplicates from a slow coordinator
        loop.start_wave(0)
    g.wait_idle_wakeups(2)  # every rank has read the messages and gone back to sleep
    assert g.ar.calls == calls
    assert all(loop.get_dp_stats().num_waves_started == 1 for loop in g.loops)


def test_abort_reaching_a_paused_rank_still_produces_its_output(groups):
    g = groups(2, interval=1)
    late = []

    def between(contributions):
        if not late and all(c[0] == 0 for c in contributions):
            late.append(g.loops[1].add_request_async(FakeRequest("doomed", 10_000)))
            g.loops[1].abort_requests(["doomed"])

    g.ar.between = between
    g.loops[0].add_request(FakeRequest("a", 2))
    outs = g.collect_until_finished(["a", "doomed"])
    g.wait_all_paused(num_waves=2)
    assert [(o.new_token_ids, o.finish_reason) for o in outs["doomed"]] == [
        ([], FinishReason.ABORT)]
    # An abort for a request this rank no longer has: no output, and nobody stays awake.
    g.loops[0].abort_requests(["a", "never-seen"])
    g.wait_all_paused(num_waves=3)
    # The abort ran in a step of wave 2, before the collective that ended it: any output it
    # made is queued by now.
    for loop in g.loops:
        assert loop.get_output(timeout=0) is None
    assert not g.cores[0].remaining and not g.cores[1].remaining


def test_peer_that_never_joins_is_an_engine_dead_error_not_a_hang(groups):
    # No coordinator: rank 1 never hears of the wave; rank 0's collective times out.
    g = groups(2, interval=1, barrier_timeout=0.3, coordinator=False)
    g.loops[0].add_request(FakeRequest("a", 100))
    deadline = time.monotonic() + DEADLINE_S
    with pytest.raises(EngineDeadError, match="sync all-reduce failed"):
        while time.monotonic() < deadline:
            g.loops[0].get_output(timeout=0.05)
    with pytest.raises(EngineDeadError):
        g.loops[0].add_request(FakeRequest("b", 1))
    with pytest.raises(EngineDeadError):
        g.loops[0].check_health()


def test_shutdown_mid_wave_releases_every_rank(groups):
    g = groups(2, interval=2, step_time=0.001)
    g.loops[0].add_request(FakeRequest("long", 1_000_000))
    assert g.loops[0].get_output(timeout=DEADLINE_S) is not None
    g.loops[1].shutdown()  # leaves at its next collective and tells rank 0
    assert not g.loops[1]._thread.is_alive()
    with pytest.raises(EngineDeadError, match="peer DP rank shut down"):
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            g.loops[0].get_output(timeout=0.05)
    assert g.cores[1].shut_down


def test_bad_arguments_raise_value_error():
    core = FakeEngineCore()
    with pytest.raises(ValueError, match="dp_rank"):
        DPEngineCoreLoop(core, dp_rank=2, dp_size=2, all_reduce=lambda v: v)
    with pytest.raises(ValueError, match="sync_interval"):
        DPEngineCoreLoop(core, dp_rank=0, dp_size=2, all_reduce=lambda v: v, sync_interval=0)
    loop = DPEngineCoreLoop(core, dp_rank=0, dp_size=1, all_reduce=lambda v: v)
    try:
        with pytest.raises(ValueError, match="num_steps"):
            loop.add_request(FakeRequest("bad", 0))
        loop.add_request(FakeRequest("ok", 2))  # the loop survives a bad request
        outs = []
        while not any(o.finished for o in outs):
            out = loop.get_output(timeout=DEADLINE_S)
            assert out is not None
            outs.extend(out.outputs)
        assert [o.new_token_ids for o in outs] == [[1], [2]]
    finally:
        loop.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_real_engine_cores_uneven_load(groups, async_scheduling):
    config = make_config(async_scheduling=async_scheduling, num_kv_blocks=24)
    cores = [EngineCore(config, FakeExecutor(num_blocks=24)) for _ in range(2)]
    g = groups(2, interval=3, cores=cores)
    want = {}
    # Everything to rank 0, in two bursts separated by a pause (small pool: preemption).
    for burst in range(2):
        for i in range(6):
            rid = f"q{burst}-{i}"
            want[rid] = (5 + 3 * i, 4 + i)  # (prompt length, max_tokens)
            g.loops[0].add_request(make_request(rid, want[rid][0], max_tokens=want[rid][1]))
        g.collect_until_finished([r for r in want if r.startswith(f"q{burst}")])
        # A burst may span more than one wave (a wave can end between two adds when the
        # fake device is fast); every rank must agree on how many there were.
        g.wait_all_paused()
        assert g.loops[0].get_dp_stats().num_waves_completed >= burst + 1
    outs = g.by_request()
    for rid, (plen, max_tokens) in want.items():
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        assert tokens == [expected_token(rid, plen + k) for k in range(max_tokens)], rid
    assert list(g.loops[0].wave_log) == list(g.loops[1].wave_log)
    assert g.loops[1].get_dp_stats().num_dummy_steps == g.loops[1].get_dp_stats().num_steps
