"""The EngineCore's batch queue (scheduler/core/batch_queue.py): each in-flight step's
state says what it waits for, and a step waiting for its grammar bitmask (docs/architecture.md
§3 rule 7) is the newest one and never yields a result before its sampling is sent."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from raylm.scheduler.core.batch_queue import BatchQueue, InFlightStep, StepState
from raylm.scheduler.core_outputs import CachedRequestData, SchedulerOutput


def _step(step_id: int, state: StepState = StepState.FORWARD_SENT) -> InFlightStep:
    so = SchedulerOutput(step_id, [], CachedRequestData(), {}, 0)
    return InFlightStep(so, Future(), state=state)


def test_forward_result_is_the_step_result_without_a_grammar():
    step = _step(1)
    assert step.result_future is step.forward_future


def test_sampling_sent_makes_its_future_the_result():
    step = _step(1, StepState.WAITING_FOR_BITMASK)
    with pytest.raises(AssertionError, match="deferred step 1 reached the head"):
        _ = step.result_future
    sample: Future = Future()
    step.sampling_sent(sample)
    assert step.state is StepState.SAMPLING_SENT and step.result_future is sample
    with pytest.raises(AssertionError, match="sampling sent twice"):
        step.sampling_sent(Future())


def test_queue_room_order_and_the_deferred_step():
    queue = BatchQueue(capacity=2)
    assert not queue and queue.has_room() and queue.waiting_for_bitmask() is None
    first, deferred = _step(1), _step(2, StepState.WAITING_FOR_BITMASK)
    queue.push(first)
    queue.push(deferred)
    assert len(queue) == 2 and not queue.has_room()
    assert [s.scheduler_output.step_id for s in queue] == [1, 2]
    assert queue.waiting_for_bitmask() is deferred
    assert queue.pop_head() is first
    with pytest.raises(AssertionError, match="scheduled behind a step waiting"):
        queue.push(_step(3))
    deferred.sampling_sent(Future())
    assert queue.waiting_for_bitmask() is None
    queue.clear()
    assert not queue
