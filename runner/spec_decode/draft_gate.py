"""When drafting cannot pay, stop: a per-request rule for how many drafts to propose.

Draft j is accepted with probability p**j and pays iff p**j >= c, the cost of a verified
position in units of an emitted token (``step_position_cost``); a request proposes the
largest such j <= k, with p estimated from its decayed acceptance history. When not even
one pays, the gate closes for a doubling back-off, then probes with one draft.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _GateState:
    successes: float
    trials: float
    closed_for: int = 0  # decode steps left without drafts
    probe: bool = False  # the next decode step probes with one draft
    cost: float = 0.0  # the position cost of the request's latest decode step
    backoff: int = 0  # the current back-off; 0: the gate has not closed since it paid


# How fast a request's acceptance estimate forgets, per verifying step. Prompt lookup's
# acceptance changes with the text (a quote starts or ends), so it forgets fast; a draft
# model's or head's is a property of the drafter on ordinary text, so it forgets slowly:
# at 0.8 a head accepted ~45% of the time looked worthless after a hard stretch (about 16
# rejected steps) and the gate shut it for 8-32 steps, drafting in 51 of 83 steps at
# batch 1 where 0.95 drafts in nearly all of them (bench/spec_decode.py,
# docs/performance.md). A drafter that is never right is still shut within 16 steps.
PROMPT_LOOKUP_DECAY = 0.8
DRAFTER_DECAY = 0.95


def step_position_cost(num_reqs: int, step_overhead_tokens: float) -> float:
    """The cost of one more verified position in a step of ``num_reqs`` decodes, in units
    of one emitted token. Model: a step costs ``a + b * T`` for T positions; with
    ``step_overhead_tokens`` = a / b, a decode step emits num_reqs tokens for
    ``a + b * num_reqs``, and one more position costs b, i.e.
    num_reqs / (num_reqs + step_overhead_tokens) tokens. A lone request's step is mostly
    overhead, so its extra positions are nearly free; a large batch already keeps the
    device busy, so an extra position costs nearly what a decoded token does."""
    return num_reqs / (num_reqs + step_overhead_tokens)


class DraftGate:
    def __init__(self, position_cost: float = 0.25, decay: float = 0.8,
                 min_backoff: int = 8, max_backoff: int = 128) -> None:
        assert 0.0 < position_cost < 1.0, position_cost
        assert 0.0 < decay < 1.0, decay
        assert 1 <= min_backoff <= max_backoff, (min_backoff, max_backoff)
        self.position_cost = position_cost
        self.decay = decay
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self._state: dict[str, _GateState] = {}

    @staticmethod
    def _prior() -> tuple[float, float]:
        return 1.0, 1.0  # one pseudo-trial, accepted: p starts at 1

    def acceptance(self, req_id: str) -> float:
        """The estimated per-draft acceptance probability p of ``req_id``."""
        st = self._state.get(req_id)
        return 1.0 if st is None else st.successes / st.trials

    def num_drafts(self, req_id: str, k: int, position_cost: float | None = None) -> int:
        """How many of ``k`` booked drafts ``req_id`` proposes in this decode step (call
        once per decode step that booked drafts). ``position_cost``: this step's cost of a
        verified position, if not the gate's own (see ``step_position_cost``)."""
        cost = self.position_cost if position_cost is None else position_cost
        st = self._state.get(req_id)
        if st is None:
            st = self._state[req_id] = _GateState(*self._prior())
        st.cost = cost
        if st.closed_for > 0:
            st.closed_for -= 1
            st.probe = st.closed_for == 0
            return 0
        if st.probe:  # p = cost: exactly one draft pays
            st.successes, st.trials, st.probe = cost, 1.0, False
        n = self._num_paying(st.successes / st.trials, k, cost)
        if n == 0:
            st.backoff = min(2 * st.backoff, self.max_backoff) if st.backoff else \
                self.min_backoff
            st.closed_for = st.backoff
        return n

    def peek(self, req_id: str, k: int, position_cost: float | None = None) -> int:
        """What ``num_drafts`` would answer now, without counting a decode step."""
        cost = self.position_cost if position_cost is None else position_cost
        st = self._state.get(req_id)
        if st is None:
            successes, trials = self._prior()
            return self._num_paying(successes / trials, k, cost)
        if st.closed_for > 0:
            return 0
        return self._num_paying(cost if st.probe else st.successes / st.trials, k, cost)

    @staticmethod
    def _num_paying(p: float, k: int, cost: float) -> int:
        """The largest n <= k with p**n >= cost (draft j pays iff p**j >= cost)."""
        n, pj = 0, p
        while n < k and pj >= cost:
            n, pj = n + 1, pj * p
        return n

    def observe(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verifying step of ``req_id``: ``num_accepted`` of ``num_proposed`` drafts."""
        if num_proposed == 0:
            return
        assert 0 <= num_accepted <= num_proposed, (req_id, num_accepted, num_proposed)
        st = self._state.get(req_id)
        if st is None:
            st = self._state[req_id] = _GateState(*self._prior())
        failed = num_accepted < num_proposed
        st.successes = self.decay * st.successes + num_accepted
        st.trials = self.decay * st.trials + num_accepted + failed
        if (st.cost or self.position_cost) <= st.successes / st.trials:
            st.backoff = 0  # it pays again: the next closure starts from min_backoff

    def forget(self, req_id: str) -> None:
        self._state.pop(req_id, None)
