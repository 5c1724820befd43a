"""The draft gate's rule, step by step (no model, no timing): a request proposes draft j
only while its estimated acceptance p**j pays for a verified position; when none pays it
backs off for a doubling number of steps and probes with a single draft."""

from __future__ import annotations

import pytest

from raylm.runner.spec_decode.draft_gate import DraftGate


def _run(gate: DraftGate, accept, steps: int, k: int = 3) -> list[int]:
    """Drafts proposed at each decode step; ``accept(step, n)`` is how many of the n
    proposed drafts the target accepts."""
    proposed = []
    for step in range(steps):
        n = gate.num_drafts("r", k)
        if n:
            gate.observe("r", n, accept(step, n))
        proposed.append(n)
    return proposed


def test_drafts_that_always_hit_keep_all_k():
    gate = DraftGate(position_cost=0.25)
    assert _run(gate, lambda step, n: n, 50) == [3] * 50
    assert gate.acceptance("r") == pytest.approx(1.0)


def test_drafts_that_always_miss_back_off_doubling_with_single_draft_probes():
    gate = DraftGate(position_cost=0.25, decay=0.8, min_backoff=8, max_backoff=32)
    proposed = _run(gate, lambda step, n: 0, 200)
    # Optimistic start (p = 1): k drafts; after a miss p = 0.8 / 1.8 = 0.44 pays one
    # draft (0.44**2 < 0.25), after another 0.64 / 2.44 = 0.26 still one, then 0.17: off.
    assert proposed[:4] == [3, 1, 1, 0]
    # Then off for 8, 16, 32, 32, ... steps, each back-off ended by a one-draft probe;
    # a rejected probe closes the gate at the next step.
    probes = [i for i, n in enumerate(proposed) if n and i > 3]
    assert all(proposed[i] == 1 for i in probes)
    gaps = [b - a for a, b in zip([2] + probes, probes, strict=False)]
    assert gaps == [8 + 2, 16 + 2, 32 + 2, 32 + 2, 32 + 2, 32 + 2], gaps
    assert sum(proposed) == 3 + 1 + 1 + len(probes)  # verified positions wasted in 200 steps


def test_a_probe_that_hits_reopens_and_resets_the_back_off():
    gate = DraftGate(position_cost=0.25, decay=0.8, min_backoff=8, max_backoff=64)
    hit_from = 60  # the request's text starts repeating itself here
    proposed = _run(gate, lambda step, n: n if step >= hit_from else 0, 120)
    first_probe_after = next(i for i, n in enumerate(proposed) if n and i >= hit_from)
    # Probes at steps 12, 30 and 64 (back-offs 8, 16, 32): the one at 64 is accepted,
    # p = (0.8 * 0.25 + 1) / 1.8 = 0.67 and 0.67**3 >= 0.25: all k drafts from then on.
    assert first_probe_after == 64, proposed
    assert proposed[64] == 1 and proposed[65:] == [3] * 55
    # It pays again, so a later closure starts from the shortest back-off.
    assert gate._state["r"].backoff == 0


def test_partial_acceptance_proposes_only_the_positions_that_pay():
    # Every step accepts the first draft and rejects the second (a step of one draft
    # sees no rejection). With cheap positions p settles at 1/2: two drafts pay
    # (0.25 >= 0.2), a third does not (0.125 < 0.2).
    cheap = DraftGate(position_cost=0.2, decay=0.8)
    assert _run(cheap, lambda step, n: min(n, 1), 60, k=5)[-40:] == [2] * 40
    assert cheap.acceptance("r") == pytest.approx(0.5, abs=1e-3)
    # With dearer positions the second draft pays only while p >= sqrt(0.3) = 0.55: the
    # request alternates between one and two drafts, never more, never none.
    dear = DraftGate(position_cost=0.3, decay=0.8)
    assert set(_run(dear, lambda step, n: min(n, 1), 60, k=5)[-40:]) == {1, 2}


def test_forget_restarts_a_request_and_requests_are_independent():
    gate = DraftGate()
    _run(gate, lambda step, n: 0, 10)
    assert gate.num_drafts("other", 3) == 3
    gate.forget("r")
    assert gate.num_drafts("r", 3) == 3


def test_the_position_cost_grows_with_the_batch():
    from raylm.runner.spec_decode.draft_gate import step_position_cost

    assert step_position_cost(1, 24) == pytest.approx(0.04)
    assert step_position_cost(8, 24) == pytest.approx(0.25)
    assert step_position_cost(32, 24) == pytest.approx(32 / 56)
    # A request whose drafts are accepted half the time (each step of two drafts
    # accepts one): beside no one it drafts all k (0.5**3 >= 0.04), in a batch of 8 two
    # (0.5**2 >= 0.25 > 0.5**3), in a batch of 32 none (0.5 < 0.57).
    gate = DraftGate()
    for _ in range(60):
        gate.observe("r", 2, 1)
    assert gate.acceptance("r") == pytest.approx(0.5, abs=1e-4)
    assert [gate.num_drafts("r", 3, step_position_cost(b, 24)) for b in (1, 8, 32)] == [3, 2, 0]


def test_a_drafter_right_half_the_time_outlasts_a_stretch_that_shuts_prompt_lookup():
    """At batch 1's position cost: after 20 steps right half the time, a stretch of
    rejected steps shuts prompt lookup's fast-forgetting estimate (0.8) within 20 steps,
    while a draft model's or head's (0.95) still drafts after 60; a drafter that is never
    right is still shut within 20 steps of its first."""
    from raylm.runner.spec_decode.draft_gate import (
        DRAFTER_DECAY,
        PROMPT_LOOKUP_DECAY,
        step_position_cost,
    )

    cost = step_position_cost(1, 24.0)

    def stretch(gate: DraftGate, steps: int) -> list[int]:
        proposed = []
        for _ in range(steps):
            n = gate.num_drafts("r", 3, cost)
            if n:
                gate.observe("r", n, 0)
            proposed.append(n)
        return proposed

    gates = {}
    for decay in (PROMPT_LOOKUP_DECAY, DRAFTER_DECAY):
        gate = gates[decay] = DraftGate(decay=decay)
        for step in range(20):
            n = gate.num_drafts("r", 3, cost)
            gate.observe("r", n, n if step % 2 == 0 else 0)
    assert 0 in stretch(gates[PROMPT_LOOKUP_DECAY], 20)
    assert 0 not in stretch(gates[DRAFTER_DECAY], 60)
    assert 0 in stretch(DraftGate(decay=DRAFTER_DECAY), 20)
