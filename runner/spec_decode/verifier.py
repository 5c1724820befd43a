"""Verification on the last PP stage: sample every verified position, accept the drafts
(rejection_sampler.py), and turn the accepted runs into the step's output. The output is
copied to the host before it returns, in one copy with the step's drafts still on the
device (the one wait of the step, on the copy stream): the drafts live in the host
history, so there are no -1 placeholders to settle later. With a grammar, only the drafts
it kept are verified; the dropped ones ran in the forward and count as rejected."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from raylm.runner.async_output import AsyncOutputCopier
from raylm.runner.input_batch import InputBatch
from raylm.runner.models.llama import LlamaForCausalLM
from raylm.runner.prepare_inputs import StepBatch, upload
from raylm.runner.sample.rejection_sampler import num_accepted_drafts
from raylm.runner.sample.sampler import Sampler
from raylm.runner.sample.sampling_metadata import build_sampling_metadata
from raylm.runner.spec_decode.device_drafts import DeviceDrafts
from raylm.runner.spec_decode.verified_runs import VerifiedRuns
from raylm.runner.structured.grammar_bitmask import apply_grammar_bitmask
from raylm.scheduler.core_outputs import LogprobsLists, ModelRunnerOutput
from raylm.scheduler.structured.manager import GrammarOutput

_EMPTY = np.zeros(0, np.int64)


@dataclass
class Verification:
    """A verified step: its output, and where its emitted runs are on the device (for a
    draft model drafting the next step at once)."""

    output: ModelRunnerOutput
    sampling: np.ndarray  # batch index of each request that sampled
    sampled: torch.Tensor | None  # the verified tokens, request by request
    seg_starts: np.ndarray  # [k] where ``sampling[k]``'s run starts in ``sampled``
    base_len: np.ndarray  # [k] its known tokens before the run


class Verifier:
    def __init__(self, input_batch: InputBatch, vocab_size: int, device: torch.device,
                 runs: VerifiedRuns, num_computed: dict[str, int],
                 device_drafts: DeviceDrafts, copier: AsyncOutputCopier) -> None:
        self.input_batch = input_batch
        self.vocab_size = vocab_size
        self.device = device
        self.runs = runs
        self.device_drafts = device_drafts
        self.copier = copier
        # The rank's computed count per request, the Speculator's: set here at verification.
        self.num_computed = num_computed

    def verify(self, batch: StepBatch, hidden: torch.Tensor, drafts: dict[str, np.ndarray],
               model: LlamaForCausalLM, sampler: Sampler, grammar_output: GrammarOutput | None
               ) -> Verification:
        """``drafts``: this step's drafts on the host, cut in place to what the grammar
        kept (drafts still on the device are filled in by the copy); ``grammar_output``:
        a bitmask row per position a constrained request verifies."""
        on_device = self.device_drafts.stand_ins(drafts)
        placed = self._counts(batch, drafts)
        if grammar_output is not None:
            self._keep_grammar_drafts(drafts, grammar_output)
        num_drafts = self._counts(batch, drafts)
        sampling = np.flatnonzero(batch.sample_mask)
        if sampling.size == 0:  # only non-final prefill chunks: nothing to sample
            copied = self.copier.to_host(on_device) if on_device else []
            self.device_drafts.settle(drafts, copied)
            output = self._bookkeeping(batch, sampling, _EMPTY, _EMPTY, _EMPTY, num_drafts,
                                       placed, _EMPTY, None)
            return Verification(output, sampling, None, _EMPTY, _EMPTY)
        nd = num_drafts[sampling]
        counts = nd + 1  # verified positions per sampling row: its drafts and the bonus
        total = int(counts.sum())
        seg_starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        within = np.arange(total) - np.repeat(seg_starts, counts)
        ends = np.cumsum(batch.num_scheduled)[sampling]
        # The row's last 1 + placed positions ran its known last token and its drafts;
        # the first 1 + kept of them are verified.
        flat = np.repeat(ends - placed[sampling] - 1, counts) + within
        # Position of each verified token: after the known tokens (seq_len less drafts).
        base_len = batch.seq_lens[sampling] - placed[sampling]
        expanded = replace(batch, rows=np.repeat(batch.rows[sampling], counts),
                           seq_lens=np.repeat(base_len, counts) + within,
                           sample_mask=np.ones(total, bool))
        logits = model.compute_logits(hidden.index_select(0, upload(flat, self.device)))
        if grammar_output is not None:
            apply_grammar_bitmask(logits, [batch.req_ids[i] for i in sampling.tolist()],
                                  grammar_output, seg_starts.tolist())
        if on_device and self.input_batch.needs_history[batch.rows[sampling]].any():
            # Penalties read the drafts in the history before sampling: one copy first.
            self.device_drafts.settle(drafts, self.copier.to_host(on_device))
            on_device = []
        md = build_sampling_metadata(self.input_batch, expanded, self.vocab_size, self.device,
                                     lambda: None)  # the history holds no placeholders
        out = sampler(logits, md)
        lp = out.logprobs_tensors
        tensors = [out.sampled_token_ids]
        if lp is not None:
            tensors += [lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks]
        host = self.copier.to_host(tensors + on_device)
        self.device_drafts.settle(drafts, host[len(tensors):])
        sampled = host[0][:, 0]
        verified = [drafts.get(batch.req_ids[i], _EMPTY) for i in sampling.tolist()]
        accepted = num_accepted_drafts(sampled, np.concatenate(verified) if verified else _EMPTY,
                                       nd)
        logprob_arrays = host[1:len(tensors)] if lp is not None else None
        output = self._bookkeeping(batch, sampling, seg_starts, base_len, accepted, num_drafts,
                                   placed, sampled, logprob_arrays)
        return Verification(output, sampling, out.sampled_token_ids[:, 0], seg_starts,
                            base_len)

    @staticmethod
    def _counts(batch: StepBatch, drafts: dict[str, np.ndarray]) -> np.ndarray:
        return np.array([len(drafts.get(r, _EMPTY)) for r in batch.req_ids], np.int64)

    @staticmethod
    def _keep_grammar_drafts(drafts: dict[str, np.ndarray],
                             grammar_output: GrammarOutput) -> None:
        """Each constrained request keeps the prefix of its drafts the grammar accepts."""
        assert grammar_output.num_draft_tokens is not None, "no draft counts in the bitmask"
        for rid, kept in zip(grammar_output.structured_output_request_ids,
                             grammar_output.num_draft_tokens, strict=True):
            mine = drafts.get(rid)
            placed = 0 if mine is None else mine.size
            assert kept <= placed, f"{rid}: the grammar kept {kept} of {placed} drafts"
            if mine is not None:
                drafts[rid] = mine[:kept]

    def _bookkeeping(self, batch: StepBatch, sampling: np.ndarray, seg_starts: np.ndarray,
                     base_len: np.ndarray, accepted: np.ndarray, num_drafts: np.ndarray,
                     placed: np.ndarray, sampled: np.ndarray,
                     logprob_arrays: list[np.ndarray] | None) -> ModelRunnerOutput:
        """``num_drafts``: the drafts verified per request; ``placed``: those that ran in
        the forward (more when the grammar dropped some)."""
        ib = self.input_batch
        ib.prev_sampled_token_ids = None  # inputs come from the host history
        ib.prev_req_id_to_index = {}
        sampled_token_ids: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: list[LogprobsLists | None] = [None] * len(batch.req_ids)
        for k, i in enumerate(sampling.tolist()):
            row, length, a = int(batch.rows[i]), int(base_len[k]), int(accepted[k])
            start = int(seg_starts[k])
            sampled_token_ids[i] = self.runs.append(batch.req_ids[i], row, length,
                                                    sampled[start:start + a + 1], int(placed[i]))
            n = int(ib.num_logprobs[row])
            if logprob_arrays is not None and n >= 0:
                ids, values, ranks = (a_[start:start + a + 1] for a_ in logprob_arrays)
                logprobs[i] = LogprobsLists(ids[:, :n + 1].tolist(), values[:, :n + 1].tolist(),
                                            ranks.tolist())
        # This rank's computed count: the step's tokens less the rejected drafts.
        rejected = np.zeros(len(batch.req_ids), np.int64)
        rejected[sampling] = placed[sampling] - accepted
        for i, rid in enumerate(batch.req_ids):
            self.num_computed[rid] = int(batch.seq_lens[i] - rejected[i])
        return ModelRunnerOutput(
            req_ids=batch.req_ids, req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs if logprob_arrays is not None else None,
            num_draft_tokens=num_drafts.tolist())
