"""The Scheduler owns its collaborators (StepSettler, StructuredOutputScheduling) and shares
its state with them. That none of them imports scheduler.py back, and that no module imports
in a loop, is checked on the import graph (tests/packaging/test_layout.py)."""

from __future__ import annotations


def test_scheduler_owns_its_collaborators():
    from sched_fake_executor import make_config

    from raylm.scheduler.async_scheduler import AsyncScheduler
    from raylm.scheduler.scheduler_update import StepSettler
    from raylm.scheduler.structured.scheduling import StructuredOutputScheduling

    sched = AsyncScheduler(make_config(async_scheduling=True), 16)
    assert isinstance(sched.step_settler, StepSettler)
    assert isinstance(sched.structured_output, StructuredOutputScheduling)
    # They share the Scheduler's state, not copies of it.
    assert sched.step_settler.requests is sched.requests
    assert sched.structured_output.waiting is sched.waiting
    assert sched.waiting_for_fsm is sched.structured_output.waiting_for_fsm
    assert sched.step_settler.books_output_placeholders
    assert sched.structured_output.books_output_placeholders
