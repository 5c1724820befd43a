"""Where a verification's outcome lands on a rank: the host history, the draft gate and the
draft model's KV. The last stage records at verification, earlier PP stages when they
learn the run (the ring, or the scheduler's next step), so all ranks stay alike."""

from __future__ import annotations

import numpy as np

from raylm.runner.input_batch import InputBatch
from raylm.runner.spec_decode.draft_gate import DraftGate
from raylm.runner.spec_decode.draft_proposer import DraftModelProposer


class VerifiedRuns:
    def __init__(self, input_batch: InputBatch, gate: DraftGate,
                 draft_model: DraftModelProposer | None) -> None:
        self.input_batch = input_batch
        self.gate = gate
        self.draft_model = draft_model

    def append(self, rid: str, row: int, length: int, tokens: np.ndarray,
               placed: int) -> list[int]:
        """The run a verification emitted (accepted drafts and the bonus token) goes into
        the history after its first ``length`` tokens; returns it as a list."""
        ib = self.input_batch
        end = length + tokens.size
        ib.token_ids[row, length:end] = tokens
        ib.num_tokens[row] = end
        ib.last_sampled_pos[row] = end - 1
        run = tokens.tolist()
        ib.states[row].output_token_ids.extend(run)
        self.observe(rid, placed, tokens.size - 1, end)
        return run

    def observe(self, rid: str, placed: int, accepted: int, num_tokens: int) -> None:
        """``accepted`` of the ``placed`` drafts (one the grammar dropped cost its position
        like a rejected one); the history is now ``num_tokens`` long and the draft KV past
        it is not the request's."""
        self.gate.observe(rid, placed, accepted)
        if self.draft_model is not None:
            self.draft_model.on_verified(rid, num_tokens)
