"""The async ledger's operations: how the rules move a Request's counters.

The counters live on ``Request`` (scheduler/request.py); the scheduler moves them by the
rules of docs/architecture.md §3 only through these functions, so each rule has one home:
booking at schedule time, the skip that keeps a step from producing nothing, settling a
returned step, the roll-back of a failed KV load, and the reset of a preemption. Both modes share them; only async
scheduling books output placeholders. (The PP decode cadence, §4, is AsyncScheduler's.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylm.scheduler.request import Request


# ---- schedule time ---------------------------------------------------------------------
def book_scheduled_tokens(request: Request, num_scheduled: int,
                          spec_token_placeholders: list[int]) -> None:
    """Book a scheduled step's tokens as computed and in flight, and its drafts as ``-1``
    placeholders unless it is a non-final prefill chunk (docs/architecture.md §3 rule 1)."""
    request.num_computed_tokens += num_scheduled
    request.num_in_flight_tokens += num_scheduled
    # Decided before this step's output placeholders are booked: a last prefill chunk
    # would look like a decode otherwise.
    request.is_prefill_chunk = request.num_computed_tokens < (
        request.num_tokens + request.num_output_placeholders)
    if spec_token_placeholders and not request.is_prefill_chunk:
        # Drafts for the step after this one, proposed by the workers (shared, read-only).
        request.spec_token_ids = spec_token_placeholders


def book_output_placeholders(request: Request, num_drafts: int,
                             num_sampled_tokens_per_step: int = 1) -> None:
    """Async: a decode books the ``num_sampled_tokens_per_step + num_drafts`` outputs it
    may return before they are seen (docs/architecture.md §3 rule 1): 1 + drafts
    autoregressively, the canvas alone for a diffusion model."""
    request.num_output_placeholders += num_sampled_tokens_per_step + num_drafts


def in_flight_steps_yield_all_tokens(request: Request) -> bool:
    """Whether the steps in flight already yield every token the request may still emit,
    so a new step could produce none (docs/architecture.md §3 rule 2)."""
    return (request.num_output_placeholders > 0
            and request.num_computed_tokens + 2 - request.num_output_placeholders
            >= request.num_prompt_tokens + request.max_tokens)


def has_unsettled_earlier_tokens(request: Request, num_booked_by_step: int) -> bool:
    """Whether placeholders beyond a step's own booking are unsettled: a constrained
    request's grammar has not seen its earlier tokens yet (docs/architecture.md §3 rule 7)."""
    return request.num_output_placeholders > num_booked_by_step


# ---- result time -----------------------------------------------------------------------
def settle_in_flight_tokens(request: Request, num_scheduled: int, step_id: int) -> bool:
    """Settle a returned step's scheduled tokens. True when they predate a preemption:
    drained from the stale count, never appended (docs/architecture.md §3 rule 4)."""
    request.num_in_flight_tokens -= num_scheduled
    assert request.num_in_flight_tokens >= 0, (
        f"{request.request_id}: in-flight tokens {request.num_in_flight_tokens} after "
        f"settling {num_scheduled} of step {step_id}")
    if request.num_stale_output_tokens <= 0:
        return False
    request.num_stale_output_tokens -= num_scheduled
    assert request.num_stale_output_tokens >= 0, (
        f"{request.request_id}: stale tokens {request.num_stale_output_tokens} after "
        f"draining {num_scheduled} of step {step_id}")
    return True


def roll_back_rejected_drafts(request: Request, num_rejected: int,
                              books_output_placeholders: bool) -> None:
    """Take drafts the runner rejected off the computed count and, async, off the
    placeholders (docs/architecture.md §3 rule 3). Their KV past the count is garbage."""
    request.num_computed_tokens -= num_rejected
    if books_output_placeholders:
        request.num_output_placeholders -= num_rejected


def roll_back_trimmed_tokens(request: Request, num_trimmed: int) -> None:
    """Tokens returned past a stop were computed for nothing: keep num_computed_tokens at
    every known token but the last (docs/architecture.md §3 rule 1)."""
    request.num_computed_tokens -= num_trimmed


def settle_output_placeholders(request: Request, num_returned: int) -> None:
    """Async: settle every token a step returned, those trimmed at a stop included
    (docs/architecture.md §3 rule 1)."""
    request.num_output_placeholders -= num_returned
    assert request.num_output_placeholders >= 0, (
        f"{request.request_id}: placeholders {request.num_output_placeholders} after "
        f"settling {num_returned} returned tokens")


def roll_back_failed_load(request: Request, num_good_tokens: int) -> int:
    """Some of the request's KV failed to load from outside the engine: its computed
    count returns to ``num_good_tokens`` (the end of the last block before the first
    failed one) and everything after is recomputed (docs/architecture.md §3 rule 9).
    Every token in flight for it was booked
    on the garbage and becomes stale, its placeholders and drafts go; it keeps its
    blocks. Returns how many settled tokens are lost (to recompute)."""
    settled = request.num_computed_tokens - request.num_in_flight_tokens
    assert 0 <= num_good_tokens <= settled, (
        f"{request.request_id}: roll back to {num_good_tokens} of {settled} settled tokens")
    request.num_computed_tokens = num_good_tokens
    request.num_stale_output_tokens = request.num_in_flight_tokens
    request.num_output_placeholders = 0
    request.spec_token_ids = []
    request.is_prefill_chunk = False
    request.next_decode_eligible_step = 0
    return settled - num_good_tokens


# ---- preemption ------------------------------------------------------------------------
def reset_on_preemption(request: Request) -> None:
    """Recompute from scratch: no computed tokens, placeholders or drafts; the tokens in
    flight become stale (docs/architecture.md §3 rule 4)."""
    request.num_computed_tokens = 0
    request.spec_token_ids = []
    request.num_stale_output_tokens = request.num_in_flight_tokens
    request.num_output_placeholders = 0
    request.is_prefill_chunk = False
    request.next_decode_eligible_step = 0
    request.num_preemptions += 1
