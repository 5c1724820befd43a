"""Each operation of scheduler/async_ledger.py on its own (docs/architecture.md §3): the
counters it moves and the ones it leaves alone. The rules end to end are in
test_ledger_rules.py and the property test of test_engine_property.py."""

from __future__ import annotations

import pytest
from sched_fake_executor import make_request

from raylm.scheduler.async_ledger import (
    book_output_placeholders,
    book_scheduled_tokens,
    has_unsettled_earlier_tokens,
    in_flight_steps_yield_all_tokens,
    reset_on_preemption,
    roll_back_rejected_drafts,
    roll_back_trimmed_tokens,
    settle_in_flight_tokens,
    settle_output_placeholders,
)

LEDGER = ("num_computed_tokens", "num_output_placeholders", "num_in_flight_tokens",
          "num_stale_output_tokens", "is_prefill_chunk", "next_decode_eligible_step")


def _ledger(request) -> dict:
    return {name: getattr(request, name) for name in LEDGER}


def test_book_scheduled_tokens_prefill_chunk_then_last_chunk_with_drafts():
    r = make_request("a", 10, max_tokens=5)
    drafts = [-1, -1]
    book_scheduled_tokens(r, 6, drafts)
    assert (r.num_computed_tokens, r.num_in_flight_tokens, r.is_prefill_chunk) == (6, 6, True)
    assert r.spec_token_ids == []  # a non-final chunk gets no drafts
    book_scheduled_tokens(r, 4, drafts)
    assert (r.num_computed_tokens, r.num_in_flight_tokens, r.is_prefill_chunk) == (10, 10, False)
    assert r.spec_token_ids is drafts  # the shared read-only placeholders
    assert r.num_output_placeholders == 0  # output placeholders are async's alone


def test_book_output_placeholders_counts_the_drafts():
    r = make_request("a", 4)
    book_output_placeholders(r, 0)
    book_output_placeholders(r, 3)
    assert r.num_output_placeholders == 5


@pytest.mark.parametrize(("max_tokens", "num_confirmed", "in_flight", "skip"), [
    (1, 0, True, True), (2, 0, True, False), (2, 1, True, True), (3, 1, True, False),
    (2, 1, False, False)])
def test_rule2_skip_when_in_flight_steps_yield_every_token(max_tokens, num_confirmed,
                                                           in_flight, skip):
    # 5-token prompt, ``num_confirmed`` outputs back, and one sampling step in flight (or
    # none): computed = every known or booked token but the last.
    r = make_request("a", 5, max_tokens=max_tokens)
    r.append_output_token_ids([7] * num_confirmed)
    r.num_output_placeholders = int(in_flight)
    r.num_computed_tokens = r.num_tokens + r.num_output_placeholders - 1
    assert in_flight_steps_yield_all_tokens(r) is skip


def test_rule7_unsettled_earlier_tokens():
    r = make_request("a", 4)
    r.num_output_placeholders = 3
    assert has_unsettled_earlier_tokens(r, 2)
    assert not has_unsettled_earlier_tokens(r, 3)


def test_settle_in_flight_tokens_then_drain_stale():
    r = make_request("a", 4)
    r.num_in_flight_tokens = 7
    assert settle_in_flight_tokens(r, 4, step_id=1) is False
    assert r.num_in_flight_tokens == 3
    r.num_stale_output_tokens = 3
    assert settle_in_flight_tokens(r, 3, step_id=2) is True  # drained, not appended
    assert (r.num_in_flight_tokens, r.num_stale_output_tokens) == (0, 0)
    with pytest.raises(AssertionError, match="in-flight tokens -1 after settling 1 of step 3"):
        settle_in_flight_tokens(r, 1, step_id=3)


@pytest.mark.parametrize("books", [False, True])
def test_rule3_roll_back_rejected_drafts(books):
    r = make_request("a", 4)
    r.num_computed_tokens, r.num_output_placeholders = 12, 4
    roll_back_rejected_drafts(r, 2, books_output_placeholders=books)
    assert r.num_computed_tokens == 10
    assert r.num_output_placeholders == (2 if books else 4)


def test_rule1_roll_back_tokens_trimmed_at_a_stop():
    r = make_request("a", 6)
    r.num_computed_tokens = 8
    roll_back_trimmed_tokens(r, 1)
    assert r.num_computed_tokens == 7


def test_rule1_settle_output_placeholders_never_below_zero():
    r = make_request("a", 4)
    r.num_output_placeholders = 2
    settle_output_placeholders(r, 2)
    assert r.num_output_placeholders == 0
    with pytest.raises(AssertionError, match="placeholders -1 after settling 1"):
        settle_output_placeholders(r, 1)


def test_rule4_reset_on_preemption():
    r = make_request("a", 8)
    r.num_computed_tokens, r.num_output_placeholders, r.num_in_flight_tokens = 11, 2, 3
    r.spec_token_ids, r.is_prefill_chunk, r.next_decode_eligible_step = [-1], True, 9
    reset_on_preemption(r)
    assert _ledger(r) == {"num_computed_tokens": 0, "num_output_placeholders": 0,
                          "num_in_flight_tokens": 3, "num_stale_output_tokens": 3,
                          "is_prefill_chunk": False, "next_decode_eligible_step": 0}
    assert r.spec_token_ids == [] and r.num_preemptions == 1
