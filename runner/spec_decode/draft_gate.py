"""When drafting cannot pay, stop: a per-request rule for how many drafts to propose.

Model: a verifying step accepts draft j only if drafts 1..j-1 were accepted, each with the
same probability p, so draft j is accepted with probability p**j. Verifying a draft
position costs ``position_cost`` (in units of the cost of one emitted token) and an
accepted draft saves one token's worth, so draft j pays iff p**j >= position_cost. A
request proposes the drafts that pay: the largest j <= k with p**j >= position_cost.

Estimate of p: a step that verified d drafts and accepted a of them observed a successes,
plus one failure when a < d (the run stopped at a rejection); p is successes / trials
over the request's verifying steps, older steps decayed by ``decay`` per step, starting
from one optimistic pseudo-success (drafting is tried first).

Back-off: when not even one draft pays, the request drafts nothing for ``backoff`` of its
decode steps (a decode then runs one token, as without speculation), then probes: the
estimate restarts at p = position_cost, so the probe proposes one draft; accepted, p
rises and drafting resumes; rejected, the gate closes again for twice as long (up to
``max_backoff``). A request whose drafts always miss thus costs one verified position
per back-off after its first few steps; a step whose estimate pays resets the back-off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _GateState:
    successes: float
    trials: float
    closed_for: int = 0  # decode steps left without drafts
    backoff: int = 0  # the current back-off; 0: the gate has not closed since it paid


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

    def num_drafts(self, req_id: str, k: int) -> int:
        """How many of ``k`` booked drafts ``req_id`` proposes in this decode step (call
        once per decode step that booked drafts)."""
        st = self._state.get(req_id)
        if st is None:
            st = self._state[req_id] = _GateState(*self._prior())
        if st.closed_for > 0:
            st.closed_for -= 1
            if st.closed_for == 0:  # the next step probes with one draft
                st.successes, st.trials = self.position_cost, 1.0
            return 0
        p = st.successes / st.trials
        n, pj = 0, p
        while n < k and pj >= self.position_cost:
            n, pj = n + 1, pj * p
        if n == 0:
            st.backoff = min(2 * st.backoff, self.max_backoff) if st.backoff else \
                self.min_backoff
            st.closed_for = st.backoff
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
        if self.position_cost <= st.successes / st.trials:
            st.backoff = 0  # it pays again: the next closure starts from min_backoff

    def forget(self, req_id: str) -> None:
        self._state.pop(req_id, None)
