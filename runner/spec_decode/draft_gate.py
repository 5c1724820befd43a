"""When drafting cannot pay, stop: a per-request gate on proposals.

Verifying a rejected draft costs a forward position and buys nothing. The gate keeps an
exponential moving average of each request's acceptance rate (accepted / proposed per
verifying step); when it falls under ``min_acceptance`` the request proposes nothing (its
decodes run one token, as without speculation) for ``backoff_steps`` of its steps, then
one probe step drafts again and either reopens the gate or closes it for another backoff.
A request that never finds a lookup match costs nothing either way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _GateState:
    rate: float = 1.0  # optimistic start: drafting is tried first
    closed_for: int = 0  # decode steps left without drafts


class DraftGate:
    def __init__(self, min_acceptance: float = 0.25, backoff_steps: int = 16,
                 decay: float = 0.7) -> None:
        self.min_acceptance = min_acceptance
        self.backoff_steps = backoff_steps
        self.decay = decay
        self._state: dict[str, _GateState] = {}

    def allows(self, req_id: str) -> bool:
        """Whether this decode of ``req_id`` may draft (call once per decode step)."""
        st = self._state.setdefault(req_id, _GateState())
        if st.closed_for > 0:
            st.closed_for -= 1
            return False
        return True

    def observe(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        st = self._state.setdefault(req_id, _GateState())
        st.rate = self.decay * st.rate + (1 - self.decay) * num_accepted / num_proposed
        if st.rate < self.min_acceptance:
            st.closed_for = self.backoff_steps
            # The probe after the backoff must prove itself: one good step reopens.
            st.rate = self.min_acceptance

    def forget(self, req_id: str) -> None:
        self._state.pop(req_id, None)
