"""Drafts computed one step ahead (draft_ahead.py) wait here on the device. Their step
writes them into its input ids there and copies them to the host only at its own
verification, after the forward that used them, inside the verification's one copy of
the sampled ids (``stand_ins`` then ``settle``): the drafts never hold up a forward and
add no wait of their own. A grammar, which checks the drafts before the bitmask is
built, takes them earlier (``to_host``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.runner.async_output import AsyncOutputCopier
from raylm.runner.input_batch import InputBatch
from raylm.runner.prepare_inputs import StepBatch, upload
from raylm.runner.spec_decode.draft_proposer import DraftRequest


@dataclass(frozen=True)
class ReadyDrafts:
    """A request's drafts computed at its last verification: row ``index`` of ``drafts``
    (on the device), ``count`` of them, following a history ``num_tokens`` long."""

    num_tokens: int
    drafts: torch.Tensor
    index: int
    count: int


@dataclass(frozen=True)
class _Placed:
    """Ready drafts this step uses: the first ``count``, at ``start`` in InputBatch ``row``."""

    ready: ReadyDrafts
    count: int
    row: int
    start: int


class DeviceDrafts:
    def __init__(self, input_batch: InputBatch, device: torch.device,
                 copier: AsyncOutputCopier) -> None:
        self.input_batch = input_batch
        self.device = device
        self.copier = copier
        self._ready: dict[str, ReadyDrafts] = {}  # for each request's next step
        self._placed: dict[str, _Placed] = {}  # this step's, still on the device only
        self._sources: list[torch.Tensor] = []  # their device tensors (stand_ins)

    def store(self, wanted: list[DraftRequest], drafts: torch.Tensor) -> None:
        """``drafts`` row i: ``wanted[i]``'s drafts for its next step."""
        for i, r in enumerate(wanted):
            self._ready[r.req_id] = ReadyDrafts(r.num_tokens, drafts, i, r.max_drafts)

    def forget(self, rid: str) -> None:
        self._ready.pop(rid, None)

    def take_ready(self, wanted: list[DraftRequest], scheduled: dict[str, int]
                   ) -> dict[str, int]:
        """Of the ``wanted`` requests, those whose ready drafts follow their history as it
        is now use them (up to their ``max_drafts``): the history gets a stand-in (any
        valid id) until the verification copies the drafts out. Returns each one's count.
        The ready drafts of every other ``scheduled`` request are dropped: they were for
        this step."""
        ib = self.input_batch
        taken: list[tuple[DraftRequest, ReadyDrafts, int]] = []
        for r in wanted:
            entry = self._ready.pop(r.req_id, None)
            if entry is not None and entry.num_tokens == r.num_tokens:
                taken.append((r, entry, min(entry.count, r.max_drafts)))
        if self._ready:
            for rid in scheduled:
                self._ready.pop(rid, None)
        self._placed = {}
        for r, entry, count in taken:
            ib.token_ids[r.row, r.num_tokens:r.num_tokens + count] = 0
            ib.num_tokens[r.row] = r.num_tokens + count
            self._placed[r.req_id] = _Placed(entry, count, r.row, r.num_tokens)
        return {rid: p.count for rid, p in self._placed.items()}

    def place(self, batch: StepBatch) -> None:
        """Overwrite the stand-ins ``InputPreparer.prepare`` uploaded with the drafts, on
        the device."""
        if not self._placed:
            return
        index = {rid: i for i, rid in enumerate(batch.req_ids)}
        ends = np.cumsum(batch.num_scheduled)
        by_source: dict[int, tuple[torch.Tensor, list[np.ndarray], list[np.ndarray],
                                   list[np.ndarray]]] = {}
        for rid, p in self._placed.items():
            end = int(ends[index[rid]])  # the drafts are the row's last ``count`` inputs
            _, flat, rows, cols = by_source.setdefault(id(p.ready.drafts),
                                                       (p.ready.drafts, [], [], []))
            flat.append(np.arange(end - p.count, end))
            rows.append(np.full(p.count, p.ready.index))
            cols.append(np.arange(p.count))
        for drafts, flat, rows, cols in by_source.values():
            batch.input_ids.index_put_(
                (self._to_device(np.concatenate(flat)),),
                drafts[self._to_device(np.concatenate(rows)),
                       self._to_device(np.concatenate(cols))])

    def as_columns(self, req_ids: list[str], k: int) -> torch.Tensor:
        """The ready drafts of ``req_ids`` as rows ``[count, drafts..., -1...]`` of width
        1 + k, built on the device (rows without drafts: count 0)."""
        out = torch.full((len(req_ids), 1 + k), -1, dtype=torch.int64, device=self.device)
        counts = np.zeros(len(req_ids), np.int64)
        by_source: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for i, rid in enumerate(req_ids):
            entry = self._ready.get(rid)
            if entry is None:
                continue
            counts[i] = entry.count
            _, rows, index = by_source.setdefault(id(entry.drafts), (entry.drafts, [], []))
            rows.append(i)
            index.append(entry.index)
        out[:, 0] = self._to_device(counts)
        for drafts, rows, index in by_source.values():
            width = min(int(drafts.shape[1]), k)
            out[self._to_device(np.array(rows)), 1:1 + width] = drafts.index_select(
                0, self._to_device(np.array(index)))[:, :width]
        return out

    def stand_ins(self, step_drafts: dict[str, np.ndarray]) -> list[torch.Tensor]:
        """Each placed request's drafts into ``step_drafts`` as zeros of their count (the
        verification needs only the counts before it samples); returns the device
        tensors holding the values, for the verification's copy to take along
        (``settle`` writes them in)."""
        sources: dict[int, torch.Tensor] = {}
        for rid, p in self._placed.items():
            sources.setdefault(id(p.ready.drafts), p.ready.drafts)
            step_drafts[rid] = np.zeros(p.count, np.int64)
        self._sources = list(sources.values())
        return self._sources

    def settle(self, step_drafts: dict[str, np.ndarray], copied: list[np.ndarray]) -> None:
        """``copied``: the tensors ``stand_ins`` returned, on the host: this step's placed
        drafts into the host history and ``step_drafts``."""
        on_host = {id(t): a for t, a in zip(self._sources, copied, strict=True)}
        ib = self.input_batch
        for rid, p in self._placed.items():
            drafts = on_host[id(p.ready.drafts)][p.ready.index, :p.count]
            ib.token_ids[p.row, p.start:p.start + p.count] = drafts
            step_drafts[rid] = drafts
        self._placed, self._sources = {}, []

    def to_host(self, step_drafts: dict[str, np.ndarray]) -> None:
        """This step's placed drafts into the host history and ``step_drafts`` now (a
        grammar reads them there before the verification)."""
        sources = self.stand_ins(step_drafts)
        self.settle(step_drafts, self.copier.to_host(sources) if sources else [])

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return upload(array.astype(np.int64), self.device)
