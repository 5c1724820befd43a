"""One rank's side of speculative decoding: draft before the forward, verify after it.

The scheduler books ``k`` draft positions per decode as -1 placeholders (both scheduling
modes). Before preparing inputs, ``begin_step`` fills them: it proposes drafts from the
request's token history, writes them after its known tokens (scratch: they are not
history until accepted) and runs only as many draft positions as were proposed (none when
the lookup finds nothing, so a miss costs no compute). After the forward, ``verify``
samples every verified position (rejection_sampler.py), keeps the accepted run plus one
token, and returns the step's output.

Positions: under async scheduling the scheduler books step t+1 as if every draft of step
t were accepted, so its ``num_computed_tokens`` runs ahead of this rank's by the drafts
rejected since. The rank keeps its own count (``num_computed``) and places step t+1's
tokens from it; the KV slots booked for the optimistic case cover the real ones, and the
scheduler's count catches up (§3 rule 3) when step t's result reaches it.

Drafting is gated per request (draft_gate.py): a request proposes only the drafts whose
estimated acceptance pays for their verification, and none for a growing back-off when
not even one pays, so speculation switches itself off where it cannot pay; and with
``disable_by_batch_size`` a step that runs more requests than that drafts nothing.

The drafts are placed in the host history, so with speculative decoding a step's output
is copied to the host before it returns (no -1 history placeholders); the scheduler still
plans the next step while this one runs.

A draft model without PP drafts step t+1 inside step t, right after verification
(``_draft_after_verification``): its forwards are queued on the device behind the
verification's, reading the emitted runs from the sampler's output there (the host lays
out positions from the counts that came with the step's output), and their drafts
stay on the device: step t+1 writes them into its input ids there
(``place_device_drafts``) and copies them to the host only at its own verification,
after the forward that used them (``_drafts_to_host``). The
scheduler books k KV slots past each step for the draft KV this writes
(``EngineConfig.num_lookahead_tokens``). Step t+1's gate may take fewer of them than
were drafted (its position cost is its own batch's). A request without ready drafts
(none were drafted at step t: its gate was closed then or the batch was over
``disable_by_batch_size``; a preemption) proposes at the start of its step, as PP stages
always do: they need the drafts before their forward and only the last stage verifies.

Structured outputs: a step with grammar-constrained requests returns their drafts from
the forward (``take_draft_token_ids``) and verifies only at ``sample_tokens``, whose
bitmask has a row per verified position and says how many drafts each grammar kept;
the dropped ones ran in the forward and count as rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.runner.input_batch import InputBatch
from raylm.runner.pp_ring import RingDelivery
from raylm.runner.prepare_inputs import StepBatch, upload
from raylm.runner.sample.rejection_sampler import num_accepted_drafts
from raylm.runner.sample.sampler import Sampler
from raylm.runner.sample.sampling_metadata import build_sampling_metadata
from raylm.runner.spec_decode.draft_gate import DraftGate, step_position_cost
from raylm.runner.spec_decode.draft_proposer import DraftModelProposer, DraftRequest
from raylm.runner.spec_decode.ngram_proposer import NgramProposer
from raylm.runner.structured.grammar_bitmask import apply_grammar_bitmask
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import (
    DraftTokenIds,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from raylm.scheduler.structured.manager import GrammarOutput


@dataclass(frozen=True)
class _ReadyDrafts:
    """A request's drafts computed at its last verification: row ``index`` of ``drafts``
    (on the device), ``count`` of them, following a history ``num_tokens`` long."""

    num_tokens: int
    drafts: torch.Tensor
    index: int
    count: int


class Speculator:
    def __init__(self, engine_config: EngineConfig, input_batch: InputBatch,
                 device: torch.device, is_last_pp_rank: bool = True,
                 learns_from_ring: bool = False) -> None:
        config = engine_config.speculative_config
        assert config is not None
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.draft_model = (DraftModelProposer(engine_config, input_batch, device)
                            if config.method == "draft_model" else None)
        # A draft model's proposals cost forwards: the gate applies to both methods.
        self.gate = DraftGate()
        self.step_overhead_tokens = config.draft_step_overhead_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.input_batch = input_batch
        self.vocab_size = engine_config.model_config.vocab_size
        self.device = device
        # This rank's computed-token count per request (may trail the scheduler's).
        self.num_computed: dict[str, int] = {}
        self._drafts: dict[str, np.ndarray] = {}  # this step's proposed drafts
        # PP, a stage that does not sample: it drafts from the same history as the last
        # stage, so both propose the same drafts and run the same query lengths. It learns
        # a request's accepted run later: in sync mode from the scheduler (the next step's
        # new_token_ids), under async scheduling from the last stage's broadcast, which
        # the ring delivers pp_size steps later (``learns_from_ring``), before the
        # request's next decode (the decode cadence). Meanwhile: (history length less
        # the drafts, drafts placed) per request.
        self.is_last_pp_rank = is_last_pp_rank
        self.learns_from_ring = learns_from_ring
        self._unverified: dict[str, tuple[int, int]] = {}
        # A draft model without PP drafts step t+1 right after step t's verification
        # (the scheduler books its KV slots ahead, ``num_lookahead_tokens``).
        self.drafts_after_verification = (self.draft_model is not None
                                          and engine_config.num_lookahead_tokens > 0)
        self.num_spec_tokens = config.num_speculative_tokens
        self.max_model_len = engine_config.model_config.max_model_len
        self._next_drafts: dict[str, _ReadyDrafts] = {}
        # This step's drafts taken from ``_next_drafts``, placed on the device only:
        # (drafts, count, InputBatch row, their first position).
        self._on_device: dict[str, tuple[_ReadyDrafts, int, int, int]] = {}

    # A draft model lives beside the target: loaded, sized and given blocks with it.
    def load_model(self, ctx: ParallelContext) -> None:
        if self.draft_model is not None:
            self.draft_model.load_model(ctx)

    def kv_cache_bytes_per_block(self) -> int:
        return self.draft_model.kv_cache_bytes_per_block() if self.draft_model else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.draft_model is not None:
            self.draft_model.initialize_kv_cache(num_blocks)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return upload(array, self.device)

    def begin_step(self, so: SchedulerOutput) -> SchedulerOutput:
        """After the diff is applied: correct positions, propose and place drafts.
        Returns the SchedulerOutput to prepare (the scheduler's own is left untouched:
        it settles this step against what it booked)."""
        ib = self.input_batch
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.num_computed.pop(rid, None)
            self.gate.forget(rid)
            self._unverified.pop(rid, None)
            self._next_drafts.pop(rid, None)
            if self.draft_model is not None:
                self.draft_model.forget(rid)
        for new in so.scheduled_new_reqs:
            self.num_computed[new.req_id] = new.num_computed_tokens
        spec = so.scheduled_spec_decode_tokens
        num_scheduled = dict(so.num_scheduled_tokens)
        self._drafts = {}
        wanted: list[DraftRequest] = []
        position_cost = step_position_cost(len(num_scheduled), self.step_overhead_tokens)
        for rid, n in so.num_scheduled_tokens.items():
            row = ib.req_id_to_index[rid]
            booked = int(ib.num_computed_tokens[row])
            if not self.is_last_pp_rank and not self.learns_from_ring:
                self.num_computed[rid] = booked  # sync PP: the scheduler's count is exact
                self._observe_unverified(rid, int(ib.num_tokens[row]))
            computed = self.num_computed[rid]
            assert computed <= booked, (
                f"{rid}: rank computed {computed} tokens, the scheduler only {booked}")
            ib.num_computed_tokens[row] = computed
            ib.states[row].num_computed_tokens = computed
            num_booked = len(spec.get(rid, ()))
            if not num_booked:
                continue
            num_tokens = int(ib.num_tokens[row])
            assert computed + n - num_booked == num_tokens, (
                f"{rid}: {n - num_booked} known tokens from {computed} do not end at the "
                f"history's {num_tokens}")
            num_scheduled[rid] = n - num_booked  # plus the drafts proposed below
            num_wanted = self.gate.num_drafts(rid, num_booked, position_cost)
            if num_wanted:
                wanted.append(DraftRequest(rid, row, num_tokens, num_wanted))
        if self.disable_by_batch_size and len(num_scheduled) > self.disable_by_batch_size:
            wanted = []  # a large batch: verifying drafts costs more than it saves
        ready = self._take_ready(wanted, num_scheduled)
        for r, drafts in self._propose([r for r in wanted if r not in ready]).items():
            if drafts.size:
                ib.token_ids[r.row, r.num_tokens:r.num_tokens + drafts.size] = drafts
                ib.num_tokens[r.row] = r.num_tokens + drafts.size  # scratch, until verified
                self._drafts[r.req_id] = drafts
                num_scheduled[r.req_id] += drafts.size
        self._on_device = {}
        for r, (entry, count) in ready.items():
            # The host history gets a stand-in (any valid id) until the verification
            # copies the drafts out; the inputs get the drafts on the device.
            ib.token_ids[r.row, r.num_tokens:r.num_tokens + count] = 0
            ib.num_tokens[r.row] = r.num_tokens + count
            self._on_device[r.req_id] = (entry, count, r.row, r.num_tokens)
            num_scheduled[r.req_id] += count
        return replace(so, num_scheduled_tokens=num_scheduled,
                       total_num_scheduled_tokens=sum(num_scheduled.values()))

    def end_step_non_last(self, batch: StepBatch) -> None:
        """A stage that does not sample: drop this step's drafts from the history. Under
        async scheduling its own count assumes every draft rejected until the request's
        accepted run arrives (``receive_verified``)."""
        ib = self.input_batch
        for i, rid in enumerate(batch.req_ids):
            drafts = self._drafts.get(rid)
            placed = 0 if drafts is None else int(drafts.size)
            row = int(batch.rows[i])
            ib.num_tokens[row] -= placed
            if self.learns_from_ring:
                self.num_computed[rid] = int(batch.seq_lens[i]) - placed
                if batch.sample_mask[i]:
                    self._unverified[rid] = (int(ib.num_tokens[row]), placed)
            elif drafts is not None:
                self._unverified[rid] = (int(ib.num_tokens[row]), placed)

    def receive_verified(self, delivery: RingDelivery | None) -> None:
        """Async PP, a stage that does not sample: the runs the last stage emitted
        pp_size steps ago (``[rows, 1 + 1 + k]``: count, then the tokens) go into the
        history, and each request's count, gate and draft KV follow them as they did on
        the last stage at verification."""
        if delivery is None:
            return
        runs = delivery.pending.wait().cpu().numpy()
        for rid, index in delivery.req_id_to_index.items():
            before, placed = self._unverified.pop(rid)
            count = int(runs[index, 0])
            assert 1 <= count <= placed + 1, f"{rid}: {count} tokens for {placed} drafts"
            self._append_run(rid, self.input_batch.req_id_to_index[rid], before,
                             runs[index, 1:1 + count], placed)
            self.num_computed[rid] = before + count - 1  # the bonus token is not computed

    def _observe_unverified(self, rid: str, num_tokens: int) -> None:
        """The gate update the last stage made at verification, once the tokens are in."""
        entry = self._unverified.pop(rid, None)
        if entry is not None:
            before, num_drafts = entry
            self._observe(rid, num_drafts, num_tokens - before - 1, num_tokens)

    def _observe(self, rid: str, placed: int, accepted: int, num_tokens: int) -> None:
        """A verification's outcome: ``accepted`` of the ``placed`` drafts (a draft the
        grammar dropped cost its forward position like a rejected one), the history now
        ``num_tokens`` long; the draft KV past it is not the request's."""
        self.gate.observe(rid, placed, accepted)
        if self.draft_model is not None:
            self.draft_model.on_verified(rid, num_tokens)

    def _append_run(self, rid: str, row: int, length: int, tokens: np.ndarray,
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
        self._observe(rid, placed, tokens.size - 1, end)
        return run

    def _take_ready(self, wanted: list[DraftRequest], scheduled: dict[str, int]
                    ) -> dict[DraftRequest, tuple[_ReadyDrafts, int]]:
        """The drafts the previous verification computed for the ``wanted`` requests,
        where they follow the request's history as it is now, and how many of them to use.
        Those of every other ``scheduled`` request are dropped: they were for this step."""
        ready = {}
        for r in wanted:
            entry = self._next_drafts.pop(r.req_id, None)
            if entry is not None and entry.num_tokens == r.num_tokens:
                ready[r] = (entry, min(entry.count, r.max_drafts))
        if self._next_drafts:
            for rid in scheduled:
                self._next_drafts.pop(rid, None)
        return ready

    def place_device_drafts(self, batch: StepBatch) -> None:
        """Write the drafts that stayed on the device into the step's input ids (after
        ``InputPreparer.prepare`` uploaded the host's stand-ins): the drafts never cross
        to the host before the forward."""
        if not self._on_device:
            return
        index = {rid: i for i, rid in enumerate(batch.req_ids)}
        ends = np.cumsum(batch.num_scheduled)
        by_source: dict[int, tuple[torch.Tensor, list[np.ndarray], list[np.ndarray],
                                   list[np.ndarray]]] = {}
        for rid, (entry, count, _, _) in self._on_device.items():
            end = int(ends[index[rid]])  # the drafts are the row's last ``count`` inputs
            _, flat, rows, cols = by_source.setdefault(id(entry.drafts),
                                                       (entry.drafts, [], [], []))
            flat.append(np.arange(end - count, end))
            rows.append(np.full(count, entry.index))
            cols.append(np.arange(count))
        for drafts, flat, rows, cols in by_source.values():
            batch.input_ids.index_put_(
                (self._to_device(np.concatenate(flat).astype(np.int64)),),
                drafts[self._to_device(np.concatenate(rows).astype(np.int64)),
                       self._to_device(np.concatenate(cols).astype(np.int64))])

    def _drafts_to_host(self) -> None:
        """The drafts placed on the device this step, into the host history and
        ``_drafts`` (verification and the grammar read them there): one copy per
        verification that computed them, after the forward that used them."""
        on_host: dict[int, np.ndarray] = {}
        ib = self.input_batch
        for rid, (entry, count, row, start) in self._on_device.items():
            key = id(entry.drafts)
            if key not in on_host:
                on_host[key] = entry.drafts.cpu().numpy()
            drafts = on_host[key][entry.index, :count]
            ib.token_ids[row, start:start + count] = drafts
            self._drafts[rid] = drafts
        self._on_device = {}

    def _draft_after_verification(self, batch: StepBatch, sampling: np.ndarray,
                                  sampled: torch.Tensor, seg_starts: np.ndarray,
                                  base_len: np.ndarray) -> None:
        """Draft the next step of every request that sampled here, now: the draft model
        reads each emitted run from the sampler's output on the device (``sampled``, the
        run of ``sampling[k]`` from ``seg_starts[k]``, after ``base_len[k]`` known tokens;
        the host supplies only the counts, which came with the step's output), its
        forwards go to the device behind the verification's, and their argmaxes stay there
        until the next step places them. The gate is asked what it will allow then
        (``peek``), at this step's position cost; the next step's own answer may take
        fewer of them."""
        if self.disable_by_batch_size and len(batch.req_ids) > self.disable_by_batch_size:
            return  # a batch this large drafts nothing (its next step decides again)
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
        if not wanted:
            return
        assert self.draft_model is not None
        drafts = self.draft_model.propose(wanted, sampled)
        for i, r in enumerate(wanted):
            self._next_drafts[r.req_id] = _ReadyDrafts(r.num_tokens, drafts, i, r.max_drafts)

    def _propose(self, wanted: list[DraftRequest]) -> dict[DraftRequest, np.ndarray]:
        if not wanted:
            return {}
        if self.ngram is not None:
            ib = self.input_batch
            return {r: self.ngram.propose(ib.token_ids[r.row, :r.num_tokens], r.max_drafts).copy()
                    for r in wanted}
        assert self.draft_model is not None
        drafts = self.draft_model.propose(wanted).cpu().numpy()
        return {r: drafts[i, :r.max_drafts] for i, r in enumerate(wanted)}

    def take_draft_token_ids(self, req_ids: list[str]) -> DraftTokenIds:
        """This step's drafts of ``req_ids`` (grammar-constrained requests: the grammar
        checks them before ``verify``)."""
        self._drafts_to_host()
        return DraftTokenIds(list(req_ids), [
            self._drafts[r].tolist() if r in self._drafts else [] for r in req_ids])

    def _keep_grammar_drafts(self, grammar_output: GrammarOutput) -> None:
        """Drop the drafts the grammar refused (each request keeps the prefix it accepts);
        their positions ran in the forward and count as rejected."""
        assert grammar_output.num_draft_tokens is not None, "no draft counts in the bitmask"
        for rid, kept in zip(grammar_output.structured_output_request_ids,
                             grammar_output.num_draft_tokens, strict=True):
            drafts = self._drafts.get(rid)
            placed = 0 if drafts is None else drafts.size
            assert kept <= placed, f"{rid}: the grammar kept {kept} of {placed} drafts"
            if drafts is not None:
                self._drafts[rid] = drafts[:kept]

    @torch.inference_mode()
    def verify(self, batch: StepBatch, hidden: torch.Tensor, model: nn.Module,
               sampler: Sampler, grammar_output: GrammarOutput | None = None
               ) -> ModelRunnerOutput:
        """Sample every verified position and accept the drafts. ``grammar_output``: the
        bitmask of the step's constrained requests, a row per position they verify."""
        self._drafts_to_host()
        ib = self.input_batch
        empty = np.zeros(0, np.int64)
        placed = np.array([len(self._drafts.get(r, empty)) for r in batch.req_ids], np.int64)
        if grammar_output is not None:
            self._keep_grammar_drafts(grammar_output)
        num_drafts = np.array([len(self._drafts.get(r, empty)) for r in batch.req_ids], np.int64)
        sampling = np.flatnonzero(batch.sample_mask)
        if sampling.size == 0:  # only non-final prefill chunks: nothing to sample
            return self._bookkeeping(batch, sampling, empty, empty, empty, num_drafts, placed,
                                     empty, None)
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
        logits = model.compute_logits(hidden.index_select(0, self._to_device(flat)))
        if grammar_output is not None:
            apply_grammar_bitmask(logits, [batch.req_ids[i] for i in sampling.tolist()],
                                  grammar_output, seg_starts.tolist())
        md = build_sampling_metadata(ib, expanded, self.vocab_size, self.device,
                                     lambda: None)  # the history holds no placeholders
        out = sampler(logits, md)
        lp = out.logprobs_tensors
        tensors = [out.sampled_token_ids]
        if lp is not None:
            tensors += [lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks]
        host = [t.cpu().numpy() for t in tensors]
        sampled = host[0][:, 0]
        drafts = [self._drafts.get(batch.req_ids[i], empty) for i in sampling.tolist()]
        accepted = num_accepted_drafts(sampled, np.concatenate(drafts) if drafts else empty, nd)
        result = self._bookkeeping(batch, sampling, seg_starts, base_len, accepted, num_drafts,
                                   placed, sampled, host[1:] if lp is not None else None)
        if self.drafts_after_verification:
            self._draft_after_verification(batch, sampling, out.sampled_token_ids[:, 0],
                                           seg_starts, base_len)
        return result

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
            sampled_token_ids[i] = self._append_run(batch.req_ids[i], row, length,
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
