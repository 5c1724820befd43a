"""The Scheduler owns its collaborators (StepSettler, StructuredOutputScheduling,
KVTransferScheduling) and its state: they read its requests through a read-only view and
never hold its waiting queue. That none of them imports scheduler.py back, and that no module imports
in a loop, is checked on the import graph (tests/packaging/test_layout.py)."""

from __future__ import annotations


def test_scheduler_owns_its_collaborators():
    from sched_fake_executor import make_config

    from raylm.scheduler.async_scheduler import AsyncScheduler
    from raylm.scheduler.scheduler_update import StepSettler
    from raylm.scheduler.structured.structured_output_scheduling import StructuredOutputScheduling

    sched = AsyncScheduler(make_config(async_scheduling=True), 16)
    assert isinstance(sched.step_settler, StepSettler)
    assert isinstance(sched.structured_output, StructuredOutputScheduling)
    # A read-only view of the Scheduler's requests, not a copy: it sees every change and
    # makes none.
    for view in (sched.step_settler.requests, sched.structured_output.requests):
        assert view is not sched.requests and not hasattr(view, "__setitem__")
    sched.requests["r"] = object()
    assert "r" in sched.step_settler.requests and "r" in sched.structured_output.requests
    del sched.requests["r"]
    # Nobody else holds the waiting queue.
    for collaborator in (sched.step_settler, sched.structured_output, sched.kv_transfer):
        assert not any(v is sched.waiting for v in vars(collaborator).values())
    assert sched.waiting_for_fsm is sched.structured_output.waiting_for_fsm
    assert sched.step_settler.books_output_placeholders
    assert sched.structured_output.books_output_placeholders
