"""Recurrent state of state-space layers (Mamba2): one slot per running request.

A request's state is one fixed-size tensor per layer, whatever its length, so it is held in
a slot, not in KV blocks (vLLM's ``mamba_cache_mode="none"``: no prefix caching of
states). A request takes a slot when the worker adds it and gives it back when the worker
drops it (finished, aborted or preempted: a preempted request recomputes from its first
token, so its state restarts from zero). The worker never holds more requests than
``max_num_seqs``, so that many slots suffice. Under async scheduling a slot given back may
still be written by a step in flight; the request that takes it next starts from zeros
(``has_state`` False) and its writes come later in the device's order, so the stale
state is never read.

``StateMetadata`` is one step's view for the layers: which rows continue a state (a
decode or a later prefill chunk), which start one, and their slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class StateSlots:
    """Slot numbers of the requests a worker holds."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._held: dict[str, int] = {}

    def assign(self, req_id: str) -> int:
        if req_id in self._held:
            raise ValueError(f"request {req_id!r} already holds state slot "
                             f"{self._held[req_id]}.")
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are held (max_num_seqs): "
                               f"the worker holds more requests than the scheduler runs.")
        slot = self._free.pop()
        self._held[req_id] = slot
        return slot

    def release(self, req_id: str) -> None:
        slot = self._held.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_held(self) -> int:
        return len(self._held)


@dataclass(frozen=True)
class StateSpan:
    """A row that runs through the chunked scan: tokens [start, end), its slot, whether it
    continues a state (a later prefill chunk) or starts from zeros."""

    start: int
    end: int
    slot: int
    has_state: bool


@dataclass
class StateMetadata:
    spans: list[StateSpan]
    # One-token rows that continue a state (decodes), run together: their token index in
    # the step and their slot, on the device.
    decode_tokens: torch.Tensor | None
    decode_slots: torch.Tensor | None

    @classmethod
    def build(cls, query_start_loc: np.ndarray, slots: np.ndarray, num_computed: np.ndarray,
              device: torch.device) -> StateMetadata:
        """``query_start_loc`` [B + 1], ``slots`` and ``num_computed`` [B] (host)."""
        lengths = np.diff(query_start_loc)
        decode = (lengths == 1) & (num_computed > 0)
        spans = [StateSpan(int(query_start_loc[i]), int(query_start_loc[i + 1]),
                           int(slots[i]), bool(num_computed[i] > 0))
                 for i in np.flatnonzero(~decode & (lengths > 0)).tolist()]
        rows = np.flatnonzero(decode)
        if rows.size == 0:
            return cls(spans, None, None)
        tokens = torch.from_numpy(query_start_loc[rows].astype(np.int64)).to(device)
        slot_t = torch.from_numpy(slots[rows].astype(np.int64)).to(device)
        return cls(spans, tokens, slot_t)
