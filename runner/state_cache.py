"""Recurrent state of state-space layers (Mamba2): a group of slots per running request.

A request's state is one fixed-size tensor per layer, whatever its length, so it is held in
slots, not in KV blocks (vLLM's ``mamba_cache_mode="none"``: no prefix caching of
states). A request takes a group when the worker adds it and gives it back when the worker
drops it (finished, aborted or preempted: a preempted request recomputes from its first
token, so its state restarts from zeros). The worker never holds more requests than
``max_num_seqs``, so that many groups suffice. Under async scheduling a group given back may
still be written by a step in flight; the request that takes it next starts from zeros and
its writes come later in the device's order, so the stale state is never read.

With speculative decoding a group has 1 + k slots: a verification step leaves the state
after each of its tokens in its own slot, and the next step reads the one after the last
accepted token. Which one is known on the host before the next step is prepared: the
worker's own verified count (the step's output is copied back before the step returns), so
nothing is read from an in-flight copy; and the slots belong to the request, not to a
batch row, so rows moving (condense) cannot send a row another request's state.

``StateMetadata`` is one step's view for the layers: rows that start a state or run a long
span (the chunked scan), and rows that continue one for a few tokens (the recurrence).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class StateSlots:
    """Each request the worker holds owns a group of ``slots_per_request`` consecutive
    slots: one, or with speculative decoding one per position a verification step runs
    (the state after each of its tokens; the next step continues from the one after the
    last accepted token)."""

    def __init__(self, num_requests: int, slots_per_request: int = 1) -> None:
        self.num_requests = num_requests
        self.slots_per_request = slots_per_request
        self._free = list(range(num_requests - 1, -1, -1))  # pop() hands out 0 first
        self._held: dict[str, int] = {}

    @property
    def num_slots(self) -> int:
        return self.num_requests * self.slots_per_request

    def assign(self, req_id: str) -> int:
        """The request's group; its slots are ``group * slots_per_request + j``."""
        if req_id in self._held:
            raise ValueError(f"request {req_id!r} already holds state group "
                             f"{self._held[req_id]}.")
        if not self._free:
            raise RuntimeError(f"all {self.num_requests} state groups are held "
                               "(max_num_seqs): the worker holds more requests than the "
                               "scheduler runs.")
        group = self._free.pop()
        self._held[req_id] = group
        return group

    def release(self, req_id: str) -> None:
        group = self._held.pop(req_id, None)
        if group is not None:
            self._free.append(group)

    @property
    def num_held(self) -> int:
        return len(self._held)


@dataclass(frozen=True)
class StateSpan:
    """A row that runs through the chunked scan: tokens [start, end), the slot its state
    comes from (-1: zeros, it starts the request) and the slot its final state goes to;
    ``cuts``: (token, slot) where the scan stops to leave the state before that token in a
    snapshot slot (prefix caching's "all" mode), in order."""

    start: int
    end: int
    read_slot: int
    write_slot: int
    cuts: tuple[tuple[int, int], ...] = ()


@dataclass
class RecurrentRows:
    """Rows that continue a state for at most ``slots_per_request`` tokens (decodes,
    verification steps), run together one token offset at a time, longest rows first:
    at offset j the first ``len(tokens[j])`` rows run their j-th token and leave the
    state after it in ``write_slots[j]``."""

    read_slots: torch.Tensor  # [R] where each row's state is
    tokens: list[torch.Tensor]  # per offset: the rows' token index in the step
    write_slots: list[torch.Tensor]


@dataclass
class StateMetadata:
    spans: list[StateSpan]
    recurrent: RecurrentRows | None
    # Prefix caching: (from slots, to snapshot slots) copied once the layer's rows ran
    saves: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, query_start_loc: np.ndarray, read_slots: np.ndarray,
              groups: np.ndarray, slots_per_request: int, device: torch.device,
              saves: list[tuple[int, int]] | None = None,
              cuts: dict[int, list[tuple[int, int]]] | None = None) -> StateMetadata:
        """Host arrays per row: ``query_start_loc`` [B + 1], ``read_slots`` [B] (-1: the
        row starts its request from zeros), ``groups`` [B]; ``saves``: (slot, snapshot
        slot) copies once the rows ran; ``cuts``: per span row, where its scan stops to
        save a state (``StateSpan.cuts``)."""
        copies = None
        if saves:
            pairs = np.array(saves, dtype=np.int64)
            copies = (torch.from_numpy(np.ascontiguousarray(pairs[:, 0])).to(device),
                      torch.from_numpy(np.ascontiguousarray(pairs[:, 1])).to(device))
        cuts = cuts or {}
        lengths = np.diff(query_start_loc)
        recurrent = (read_slots >= 0) & (lengths <= slots_per_request) & (lengths > 0)
        base = groups * slots_per_request
        span_rows = np.flatnonzero(~recurrent & (lengths > 0)).tolist()
        # A recurrent row leaves the state after each of its tokens in a slot: no cuts.
        assert set(cuts) <= set(span_rows), (sorted(cuts), span_rows)
        spans = [StateSpan(int(query_start_loc[i]), int(query_start_loc[i + 1]),
                           int(read_slots[i]), int(base[i]), tuple(sorted(cuts.get(i, ()))))
                 for i in span_rows]
        rows = np.flatnonzero(recurrent)
        if rows.size == 0:
            return cls(spans, None, copies)
        rows = rows[np.argsort(-lengths[rows], kind="stable")]

        def up(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

        tokens, writes = [], []
        for j in range(int(lengths[rows[0]])):
            active = rows[lengths[rows] > j]
            tokens.append(up(query_start_loc[active] + j))
            writes.append(up(base[active] + j))
        return cls(spans, RecurrentRows(up(read_slots[rows]), tokens, writes), copies)


def state_read_slots(bases: np.ndarray, groups: np.ndarray, num_computed: np.ndarray,
                     num_scheduled: np.ndarray, slots_per_request: int,
                     restores: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Where each row's state is, from the first position of the step that wrote it
    (``bases``: the position whose state is in the group's slot 0, the state after
    position ``base + j`` in slot j) and the row's computed count, which the worker knows
    on the host (with speculative decoding: its own verified count, settled before the
    step returned); a row that starts from a prefix hit reads its snapshot slot
    (``restores``, -1 elsewhere). Returns (read slots, -1 for rows that start from zeros;
    the rows' new bases)."""
    restored = (np.zeros(num_computed.shape, bool) if restores is None else restores >= 0)
    fresh = (num_computed == 0) & ~restored
    index = num_computed - 1 - bases
    bad = ~fresh & ~restored & ((index < 0) | (index >= slots_per_request))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RuntimeError(f"row {i}: the state after position {int(num_computed[i]) - 1} "
                           f"is not among its slots (written from position "
                           f"{int(bases[i])}, {slots_per_request} slots).")
    reads = np.where(fresh, -1, groups * slots_per_request + index)
    if restores is not None:
        reads = np.where(restored, restores, reads)
    recurrent = ~fresh & (num_scheduled <= slots_per_request)
    # A recurrent row leaves the state after its j-th token in slot j; a span its final
    # state in slot 0.
    new_bases = np.where(recurrent, num_computed, num_computed + num_scheduled - 1)
    return reads, new_bases
