"""A PP stage that does not sample drafts from the same history as the last stage, so all
stages propose the same drafts and run the same query lengths. It learns each accepted
run later: in sync mode from the scheduler (the next step's ``new_token_ids``), under
async scheduling from the last stage's broadcast, which the ring delivers pp_size steps
later, before the request's next decode (docs/architecture.md §4). A draft head's drafts
come with that broadcast in both modes."""

from __future__ import annotations

import numpy as np

from raylm.runner.input_batch import InputBatch
from raylm.runner.pp_ring import RingDelivery
from raylm.runner.prepare_inputs import StepBatch
from raylm.runner.spec_decode.verified_runs import VerifiedRuns


class EarlierStageRuns:
    def __init__(self, input_batch: InputBatch, runs: VerifiedRuns,
                 num_computed: dict[str, int], learns_from_ring: bool,
                 head_drafts: int = 0) -> None:
        self.input_batch = input_batch
        self.runs = runs
        # The rank's computed count per request, the Speculator's: set here as runs arrive.
        self.num_computed = num_computed
        self.learns_from_ring = learns_from_ring
        # Until a request's run arrives: (history length less the drafts, drafts placed).
        self._unverified: dict[str, tuple[int, int]] = {}
        # A draft head on the last stage: its drafts for each request's next step arrive
        # with the run (``head_drafts`` = k columns after it), kept with the history length
        # they follow.
        self.head_drafts = head_drafts
        self._drafts: dict[str, tuple[int, np.ndarray]] = {}
        # Sync PP with a head: each sampled row's history length (drafts left out) at its
        # step, which the run its drafts follow extends.
        self._sampled_history: dict[str, int] = {}

    def forget(self, rid: str) -> None:
        self._unverified.pop(rid, None)
        self._drafts.pop(rid, None)
        self._sampled_history.pop(rid, None)

    def take_drafts(self, rid: str, num_tokens: int, max_drafts: int) -> np.ndarray | None:
        """The last stage's drafts for ``rid``'s step after ``num_tokens`` known tokens (up
        to ``max_drafts``, as many as it places), if they follow that history."""
        entry = self._drafts.pop(rid, None)
        if entry is None or entry[0] != num_tokens or entry[1].size == 0:
            return None
        return entry[1][:max_drafts].copy()

    def learn_from_scheduler(self, rid: str, booked: int, num_tokens: int) -> None:
        """Sync PP: the scheduler's count is exact and the history holds the run (its
        ``new_token_ids``); make the gate update the last stage made at verification."""
        self.num_computed[rid] = booked
        entry = self._unverified.pop(rid, None)
        if entry is not None:
            before, num_drafts = entry
            self.runs.observe(rid, num_drafts, num_tokens - before - 1, num_tokens)

    def end_step(self, batch: StepBatch, drafts: dict[str, np.ndarray]) -> None:
        """Drop this step's ``drafts`` from the history. Under async scheduling the count
        assumes every draft rejected until the request's run arrives (``receive``)."""
        ib = self.input_batch
        for i, rid in enumerate(batch.req_ids):
            mine = drafts.get(rid)
            placed = 0 if mine is None else int(mine.size)
            row = int(batch.rows[i])
            ib.num_tokens[row] -= placed
            if self.learns_from_ring:
                self.num_computed[rid] = int(batch.seq_lens[i]) - placed
                if batch.sample_mask[i]:
                    self._unverified[rid] = (int(ib.num_tokens[row]), placed)
            else:
                if mine is not None:
                    self._unverified[rid] = (int(ib.num_tokens[row]), placed)
                if self.head_drafts and batch.sample_mask[i]:
                    self._sampled_history[rid] = int(ib.num_tokens[row])

    def receive(self, delivery: RingDelivery | None) -> None:
        """The runs the last stage emitted pp_size steps ago (``[rows, 2 + k]``: count,
        then the tokens; with a head, ``1 + k`` more: its drafts' count and the drafts for
        the request's next step). Async PP: the runs go into the history, and each
        request's count, gate and draft KV follow them as they did on the last stage at
        verification. Sync PP (a head only): the scheduler brings the runs; the drafts are
        kept."""
        if delivery is None:
            return
        runs = delivery.pending.wait().cpu().numpy()
        for rid, index in delivery.req_id_to_index.items():
            count = int(runs[index, 0])
            if self.learns_from_ring:
                before, placed = self._unverified.pop(rid)
                assert 1 <= count <= placed + 1, f"{rid}: {count} tokens for {placed} drafts"
                self.runs.append(rid, self.input_batch.req_id_to_index[rid], before,
                                 runs[index, 1:1 + count], placed)
                self.num_computed[rid] = before + count - 1  # the bonus is not computed
            else:
                before = self._sampled_history.pop(rid)
            if self.head_drafts:
                k = self.head_drafts
                n = int(runs[index, 2 + k])
                self._drafts[rid] = (before + count, runs[index, 3 + k:3 + k + n].copy())
