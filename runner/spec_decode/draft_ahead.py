"""A draft model (or an EAGLE head) without PP drafts step t+1 inside step t, right after
verification: its forwards queue on the device behind the verification's and read the
emitted runs there, so drafting adds no host round trip. The scheduler books the KV slots
this writes (``EngineConfig.num_lookahead_tokens``); the drafts wait in device_drafts.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.runner.input_batch import InputBatch
from raylm.runner.prepare_inputs import StepBatch
from raylm.runner.spec_decode.device_drafts import DeviceDrafts
from raylm.runner.spec_decode.draft_gate import DraftGate, step_position_cost
from raylm.runner.spec_decode.draft_proposer import DraftModelProposer, DraftRequest
from raylm.scheduler.config.engine_config import EngineConfig


@dataclass
class DraftAhead:
    draft_model: DraftModelProposer | None  # None: an EAGLE head drafts (eagle_proposer.py)
    gate: DraftGate
    device_drafts: DeviceDrafts
    input_batch: InputBatch
    engine_config: EngineConfig

    def __post_init__(self) -> None:
        config = self.engine_config.speculative_config
        assert config is not None
        self.num_spec_tokens = config.num_speculative_tokens
        self.step_overhead_tokens = config.draft_step_overhead_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.max_model_len = self.engine_config.model_config.max_model_len

    def draft(self, batch: StepBatch, sampling: np.ndarray, sampled: torch.Tensor,
              seg_starts: np.ndarray, base_len: np.ndarray) -> None:
        """Draft the next step of every request that sampled: ``sampling[k]``'s run is in
        ``sampled`` (on the device) from ``seg_starts[k]``, after ``base_len[k]`` known
        tokens."""
        assert self.draft_model is not None  # an EAGLE head drafts through its proposer
        wanted = self.wanted(batch, sampling, seg_starts, base_len)
        if wanted:
            self.device_drafts.store(wanted, self.draft_model.propose(wanted, sampled))

    def wanted(self, batch: StepBatch, sampling: np.ndarray, seg_starts: np.ndarray,
               base_len: np.ndarray) -> list[DraftRequest]:
        """The requests that sampled and get drafts for their next step. How many: what
        the gate would allow now (``peek``), at this step's position cost; the next
        step's own answer may take fewer."""
        if self.disable_by_batch_size and len(batch.req_ids) > self.disable_by_batch_size:
            return []  # a batch this large drafts nothing (its next step decides again)
        ib = self.input_batch
        position_cost = step_position_cost(len(batch.req_ids), self.step_overhead_tokens)
        wanted = []
        for k, i in enumerate(sampling.tolist()):
            rid, row = batch.req_ids[i], int(batch.rows[i])
            num_tokens = int(ib.num_tokens[row])
            # Draft positions stop at max_model_len: the slots end there.
            room = self.max_model_len - num_tokens
            n = min(self.gate.peek(rid, self.num_spec_tokens, position_cost), room)
            if n > 0:
                wanted.append(DraftRequest(rid, row, num_tokens, n, int(base_len[k]),
                                           int(seg_starts[k])))
        return wanted
