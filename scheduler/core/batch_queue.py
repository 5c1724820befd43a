"""The EngineCore's batch queue: its steps in flight, oldest first, each with its state.

A step's forward goes out when it is scheduled; its result comes from its sampling, sent
with the forward or, when a constrained request of it still has a token in flight, only
once that token has advanced the grammar (docs/architecture.md §3 rule 7). Such a step is
always the newest: nothing is scheduled behind it until its sampling is sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any

from raylm.scheduler.core_outputs import ModelRunnerOutput, SchedulerOutput


class StepState(Enum):
    """What an in-flight step waits for."""

    FORWARD_SENT = "forward sent"  # no grammar: the forward's result is the step's
    WAITING_FOR_BITMASK = "waiting for its grammar bitmask"  # sampling not sent yet
    SAMPLING_SENT = "sampling sent"  # the sampling's result is the step's


@dataclass(eq=False)
class InFlightStep:
    scheduler_output: SchedulerOutput
    # execute_model's: the step's output, or for a constrained step None or its drafts.
    forward_future: Future[Any]
    sample_future: Future[ModelRunnerOutput] | None = None
    state: StepState = StepState.FORWARD_SENT

    def sampling_sent(self, sample_future: Future[ModelRunnerOutput]) -> None:
        assert self.state is not StepState.SAMPLING_SENT, (
            f"step {self.scheduler_output.step_id}: sampling sent twice")
        self.sample_future = sample_future
        self.state = StepState.SAMPLING_SENT

    @property
    def result_future(self) -> Future[ModelRunnerOutput]:
        """The future of the step's ModelRunnerOutput."""
        if self.sample_future is not None:
            return self.sample_future
        assert self.state is StepState.FORWARD_SENT, (
            f"deferred step {self.scheduler_output.step_id} reached the head of the batch "
            "queue before the steps its grammar waits for")
        return self.forward_future


class BatchQueue:
    """Up to ``capacity`` steps in flight (``max_concurrent_batches``), in schedule order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._steps: deque[InFlightStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def __bool__(self) -> bool:
        return bool(self._steps)

    def __iter__(self) -> Iterator[InFlightStep]:
        return iter(self._steps)

    def has_room(self) -> bool:
        return len(self._steps) < self.capacity

    def waiting_for_bitmask(self) -> InFlightStep | None:
        """The step whose sampling waits for its grammar, if any (always the newest)."""
        if self._steps and self._steps[-1].state is StepState.WAITING_FOR_BITMASK:
            return self._steps[-1]
        return None

    def push(self, step: InFlightStep) -> None:
        assert self.waiting_for_bitmask() is None, (
            f"step {step.scheduler_output.step_id} scheduled behind a step waiting for "
            "its grammar bitmask")
        self._steps.append(step)

    def pop_head(self) -> InFlightStep:
        return self._steps.popleft()

    def clear(self) -> None:
        self._steps.clear()
