"""EngineCoreLoop aborts: one hop, straight to the EngineCore's abort queue, never ahead of
the add they cancel. A fake EngineCore whose step can be held records what reaches it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from raylm.scheduler.core.engine_core_loop import EngineCoreLoop
from raylm.scheduler.core_outputs import EngineCoreOutputs

DEADLINE_S = 20.0  # only turns a hang into a failure


class HeldCore:
    """Records ("add", id) and ("abort", ids) in arrival order, and from which thread; its
    step blocks while ``hold`` is clear."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.in_step = threading.Event()
        self.requests: set[str] = set()
        self.scheduler = SimpleNamespace(validate_request=lambda request: None)
        self.executor = SimpleNamespace(check_health=lambda: None)
        self._lock = threading.Lock()

    def _record(self, kind: str, what: object) -> None:
        with self._lock:
            self.calls.append((kind, what, threading.current_thread().name))

    def add_request(self, request) -> None:
        self._record("add", request.request_id)
        self.requests.add(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._record("abort", list(request_ids))

    def has_work(self) -> bool:
        return bool(self.requests) or not self.hold.is_set()

    def step_fn(self):
        self.in_step.set()
        self.hold.wait(DEADLINE_S)
        time.sleep(0.001)
        return EngineCoreOutputs(outputs=[]), False

    def shutdown(self) -> None:
        pass


def _request(request_id: str):
    return SimpleNamespace(request_id=request_id)


def _wait(predicate) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_abort_of_an_admitted_request_is_one_hop_from_the_callers_thread():
    core = HeldCore()
    loop = EngineCoreLoop(core)
    try:
        loop.add_request(_request("a"))
        _wait(lambda: ("add", "a") in [(k, w) for k, w, _ in core.calls])
        core.hold.clear()  # the loop thread is now stuck in a step
        core.in_step.clear()
        _wait(core.in_step.is_set)
        loop.abort_requests(["a"])
        # Reached the EngineCore at once, from this thread, while the loop thread is busy.
        assert core.calls[-1] == ("abort", ["a"], threading.current_thread().name)
    finally:
        core.hold.set()
        loop.shutdown()


def test_abort_of_an_add_still_queued_waits_for_that_add():
    core = HeldCore()
    core.hold.clear()
    loop = EngineCoreLoop(core)
    try:
        _wait(core.in_step.is_set)  # the loop thread is stuck in a step
        loop.add_request(_request("b"))
        loop.abort_requests(["b", "unknown"])
        # The unknown id goes through at once; "b" waits for its add.
        assert [(k, w) for k, w, _ in core.calls] == [("abort", ["unknown"])]
        core.hold.set()
        _wait(lambda: len(core.calls) == 3)
        assert [(k, w) for k, w, _ in core.calls] == [
            ("abort", ["unknown"]), ("add", "b"), ("abort", ["b"])]
        # The deferred abort was sent by the loop thread, right after the add.
        assert core.calls[2][2] == "raylm-engine-core"
        loop.abort_requests(["b"])  # the add is in: straight through
        assert [(k, w) for k, w, _ in core.calls][-1] == ("abort", ["b"])
    finally:
        core.hold.set()
        loop.shutdown()


def test_adds_still_queued_when_the_engine_dies_each_get_an_abort():
    """A request the loop had not admitted yet when the engine died still hears one final
    ABORT output, and no add can be queued after the death (it would wait forever)."""
    import threading

    import pytest

    from raylm.scheduler.core.engine_core_loop import EngineCoreLoop
    from raylm.scheduler.core.executor_base import EngineDeadError
    from raylm.scheduler.core_outputs import FinishReason

    gate = threading.Event()

    class _Dying:
        """An EngineCore whose first step blocks until released, then fails."""

        class scheduler:  # noqa: N801 (a stand-in attribute)
            @staticmethod
            def validate_request(request):
                return None

        def __init__(self):
            self.added = []

        def add_request(self, request):
            self.added.append(request.request_id)

        def abort_requests(self, ids):
            pass

        def has_work(self):
            return bool(self.added)

        def step_fn(self):
            gate.wait(10)
            raise RuntimeError("worker died")

        def shutdown(self):
            pass

    class _Req:
        def __init__(self, rid):
            self.request_id = rid

    core = _Dying()
    loop = EngineCoreLoop(core)
    loop.add_request(_Req("first"))  # admitted; its step blocks
    deadline = __import__("time").monotonic() + 10
    while not core.added:
        assert __import__("time").monotonic() < deadline
    loop.add_request(_Req("queued-1"))  # still in the inbox when the step fails
    loop.add_request(_Req("queued-2"))
    gate.set()
    finals = {}
    with pytest.raises(EngineDeadError):
        while True:
            out = loop.get_output(timeout=10)
            assert out is not None, "no output before the death"
            finals.update({o.request_id: o.finish_reason for o in out.outputs})
    assert finals == {"queued-1": FinishReason.ABORT, "queued-2": FinishReason.ABORT}
    with pytest.raises(EngineDeadError):
        loop.add_request(_Req("late"))
    loop.shutdown()
