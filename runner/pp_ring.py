"""The sampled-token ring of a stage that does not sample (async PP, docs/architecture.md §4).

The receive of step s's broadcast is posted right after step s and consumed exactly
pp_size steps later, before step s + pp_size is prepared (the decode cadence makes that
soon enough), so a ring of pp_size slots advanced once per step, empty steps included,
needs no step ids. Each row has a generation counter bumped when its request leaves; on
delivery the tokens of rows freed in between are dropped. Pure bookkeeping: the receive
handles and the runner's payload are opaque here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class PendingSampledTokenIds(Protocol):
    """A posted receive of one step's broadcast of sampled ids."""

    def wait(self) -> Any:
        """The ids as a ``[num_rows, width]`` int64 device tensor (rows in the step's batch
        order)."""
        ...


class SampledTokenTransport(Protocol):
    """The PP layer's side of the ring (``raylm.parallel.pp_comm`` implements it)."""

    def broadcast_sampled_token_ids(self, sampled_token_ids: Any) -> None:
        """Last stage: send one step's ``[num_rows, width]`` ids to the other stages,
        without waiting for them. Width 1: the sampled id of each row. With speculative
        decoding: each row's count of emitted tokens, then the tokens (-1 padded)."""
        ...

    def recv_sampled_token_ids(self, num_rows: int, width: int = 1) -> PendingSampledTokenIds:
        """Other stages: post the receive of the current step's broadcast."""
        ...


@dataclass
class RingSlot:
    """What one step left in the ring: its pending receive and who sampled in it."""

    step_index: int  # the ring's own count of steps (0 = the first step it saw)
    pending: PendingSampledTokenIds
    req_ids: list[str]
    indices: np.ndarray  # [n] row of each request in the broadcast tensor
    rows: np.ndarray  # [n] ring row of each request when it sampled
    generations: np.ndarray  # [n] that row's generation then
    payload: Any = None  # the runner's (placeholder positions), returned as is


@dataclass
class RingDelivery:
    """A slot coming out of the ring, ``pp_size`` steps after it went in."""

    step_index: int
    pending: PendingSampledTokenIds
    keep: np.ndarray  # [n] bool: the request still holds the row it sampled in
    req_id_to_index: dict[str, int]  # the kept requests' rows in the broadcast tensor
    payload: Any

    @property
    def num_dropped(self) -> int:
        return int((~self.keep).sum())


class SampledTokenRing:
    def __init__(self, pp_size: int, initial_rows: int = 16) -> None:
        if pp_size < 2:
            raise ValueError(f"pp_size must be at least 2 for a sampled-token ring, got {pp_size}.")
        self.pp_size = pp_size
        # Slot i holds the step taken i steps after the oldest one; None = nothing sampled.
        self._slots: deque[RingSlot | None] = deque([None] * pp_size)
        self.num_steps = 0
        self.num_delivered = 0  # slots taken out with a broadcast in them
        self.num_tokens_dropped = 0  # tokens of rows freed before their delivery
        self._taken = False  # take() and put() alternate, once each per step
        self.generation = np.zeros(max(1, initial_rows), dtype=np.int64)
        self._free_rows: list[int] = list(range(len(self.generation) - 1, -1, -1))
        self._row_of: dict[str, int] = {}

    # ---- rows -------------------------------------------------------------------------
    def add_request(self, req_id: str) -> int:
        if req_id in self._row_of:
            raise ValueError(f"request {req_id!r} already holds ring row {self._row_of[req_id]}.")
        if not self._free_rows:
            n = len(self.generation)
            self.generation = np.concatenate([self.generation, np.zeros(n, np.int64)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        # LIFO: a freed row is the next one handed out, the case the generations guard.
        row = self._free_rows.pop()
        self._row_of[req_id] = row
        return row

    def remove_request(self, req_id: str) -> None:
        """The request leaves the stage; tokens it sampled before are dropped. Unknown ids
        are ignored (a finished request the stage never held)."""
        row = self._row_of.pop(req_id, None)
        if row is None:
            return
        self.generation[row] += 1
        self._free_rows.append(row)

    def row_of(self, req_id: str) -> int:
        return self._row_of[req_id]

    # ---- steps --------------------------------------------------------------------------
    def take(self) -> RingDelivery | None:
        """Before preparing the current step: the slot of the step ``pp_size`` steps ago
        (None when that step ran nothing or came before the first step)."""
        if self._taken:
            raise RuntimeError(f"ring step {self.num_steps}: take() twice without put().")
        self._taken = True
        slot = self._slots.popleft()
        if slot is None:
            return None
        assert slot.step_index == self.num_steps - self.pp_size, (
            f"ring delivers step {slot.step_index} at step {self.num_steps}, "
            f"pp_size={self.pp_size}")
        keep = self.generation[slot.rows] == slot.generations
        self.num_delivered += 1
        self.num_tokens_dropped += int((~keep).sum())
        req_id_to_index = {r: int(i) for r, i, k in
                           zip(slot.req_ids, slot.indices.tolist(), keep.tolist(), strict=True) if k}
        return RingDelivery(slot.step_index, slot.pending, keep, req_id_to_index, slot.payload)

    def put(self, pending: PendingSampledTokenIds | None,
            req_id_to_index: dict[str, int] | None = None, payload: Any = None) -> None:
        """After running the current step: its pending receive (None: the step ran no
        model, nothing is broadcast) and the row of each request that samples in it."""
        if not self._taken:
            raise RuntimeError(f"ring step {self.num_steps}: put() without take().")
        self._taken = False
        slot = None
        if pending is not None:
            index = req_id_to_index or {}
            req_ids = list(index)
            rows = np.fromiter((self._row_of[r] for r in req_ids), np.int64, len(req_ids))
            slot = RingSlot(self.num_steps, pending, req_ids,
                            np.fromiter((index[r] for r in req_ids), np.int64,
                                        len(req_ids)),
                            rows, self.generation[rows].copy(), payload)
        self._slots.append(slot)
        self.num_steps += 1

    def pending_slots(self) -> list[RingSlot]:
        """Slots still in the ring, oldest first (their receives are posted)."""
        return [s for s in self._slots if s is not None]
