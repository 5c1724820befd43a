"""One rank's side of speculative decoding: place drafts before the forward, verify after.

The scheduler books ``k`` draft positions per decode as -1 placeholders; ``begin_step``
fills only those the draft gate lets pay (none on a lookup miss, so a miss costs no
compute) and places the step from this rank's own computed count, which trails the
scheduler's optimistic one by the drafts rejected since (§3 rule 3). The collaborators:
device_drafts.py and draft_ahead.py (a draft model drafting one step ahead), verifier.py
(the last stage), earlier_stage.py (other PP stages), verified_runs.py (both)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from raylm.parallel.context import ParallelContext
from raylm.runner.async_output import AsyncOutputCopier
from raylm.runner.input_batch import InputBatch
from raylm.runner.models.llama import LlamaForCausalLM
from raylm.runner.pp_ring import RingDelivery
from raylm.runner.prepare_inputs import StepBatch
from raylm.runner.sample.sampler import Sampler
from raylm.runner.spec_decode.device_drafts import DeviceDrafts
from raylm.runner.spec_decode.draft_ahead import DraftAhead
from raylm.runner.spec_decode.draft_gate import (
    DRAFTER_DECAY,
    PROMPT_LOOKUP_DECAY,
    DraftGate,
    step_position_cost,
)
from raylm.runner.spec_decode.draft_proposer import DraftModelProposer, DraftRequest
from raylm.runner.spec_decode.eagle_proposer import EagleProposer
from raylm.runner.spec_decode.earlier_stage import EarlierStageRuns
from raylm.runner.spec_decode.ngram_proposer import NgramProposer
from raylm.runner.spec_decode.verified_runs import VerifiedRuns
from raylm.runner.spec_decode.verifier import Verifier
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import DraftTokenIds, ModelRunnerOutput, SchedulerOutput
from raylm.scheduler.structured.manager import GrammarOutput


class Speculator:
    def __init__(self, engine_config: EngineConfig, input_batch: InputBatch,
                 device: torch.device, copier: AsyncOutputCopier,
                 is_last_pp_rank: bool = True, learns_from_ring: bool = False) -> None:
        config = engine_config.speculative_config
        assert config is not None
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.draft_model = (DraftModelProposer(engine_config, input_batch, device)
                            if config.method == "draft_model" else None)
        # A head reads the target's hidden states: it runs on the last PP stage, whose
        # broadcast carries its drafts to the others (``next_drafts``).
        self.drafts_from_head = config.reads_target_hidden_states
        self.eagle = (EagleProposer(engine_config, input_batch, device)
                      if self.drafts_from_head and is_last_pp_rank else None)
        self.num_spec_tokens = config.num_speculative_tokens
        self.aux_layers = engine_config.eagle_aux_layers
        # A draft model's proposals cost forwards: the gate applies to both methods.
        self.gate = DraftGate(decay=PROMPT_LOOKUP_DECAY if config.method == "ngram"
                              else DRAFTER_DECAY)
        self.step_overhead_tokens = config.draft_step_overhead_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.input_batch = input_batch
        # This rank's computed-token count per request (may trail the scheduler's).
        self.num_computed: dict[str, int] = {}
        self._drafts: dict[str, np.ndarray] = {}  # this step's drafts in the host history
        self.runs = VerifiedRuns(input_batch, self.gate, self.draft_model)
        self.copier = copier
        self.device_drafts = DeviceDrafts(input_batch, device, copier)
        self.verifier = (Verifier(input_batch, engine_config.model_config.vocab_size, device,
                                  self.runs, self.num_computed, self.device_drafts, copier)
                         if is_last_pp_rank else None)
        self.earlier_stage = (None if is_last_pp_rank else
                              EarlierStageRuns(input_batch, self.runs, self.num_computed,
                                               learns_from_ring,
                                               self.num_spec_tokens if self.drafts_from_head
                                               else 0))
        # Without PP the scheduler books the KV slots of drafts made one step ahead (an
        # EAGLE head always drafts so: it runs without PP only).
        self.draft_ahead = (DraftAhead(self.draft_model, self.gate, self.device_drafts,
                                       input_batch, engine_config)
                            if (self.draft_model is not None or self.eagle is not None)
                            and engine_config.num_lookahead_tokens > 0 else None)

    # A draft model or head lives beside the target: loaded, sized and given blocks with it.
    def load_model(self, ctx: ParallelContext, target: LlamaForCausalLM) -> None:
        # EAGLE-3 reads three layers' inputs, which each stage keeps from its forward (the
        # last stage's head gets the earlier stages' with the hidden states).
        target.model.aux_hidden_layers = self.aux_layers
        if self.draft_model is not None:
            self.draft_model.load_model(ctx)
        if self.eagle is not None:
            self.eagle.load_model(ctx, target)

    def kv_cache_bytes_per_block(self) -> int:
        drafter = self.draft_model or self.eagle
        return drafter.kv_cache_bytes_per_block() if drafter is not None else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        drafter = self.draft_model or self.eagle
        if drafter is not None:
            drafter.initialize_kv_cache(num_blocks)

    # ---------------------------------------------------------------- before the forward
    def begin_step(self, so: SchedulerOutput) -> SchedulerOutput:
        """After the diff is applied: correct positions, propose and place drafts.
        Returns the SchedulerOutput to prepare (the scheduler's own is left untouched:
        it settles this step against what it booked)."""
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._forget(rid)
        for new in so.scheduled_new_reqs:
            self.num_computed[new.req_id] = new.num_computed_tokens
        num_scheduled, wanted = self._known_tokens(so)
        if self.disable_by_batch_size and len(num_scheduled) > self.disable_by_batch_size:
            wanted = []  # a large batch: verifying drafts costs more than it saves
        self._drafts = {}
        ready = self.device_drafts.take_ready(wanted, num_scheduled)
        ib = self.input_batch
        for r, drafts in self._propose([r for r in wanted if r.req_id not in ready]).items():
            if drafts.size:
                ib.token_ids[r.row, r.num_tokens:r.num_tokens + drafts.size] = drafts
                ib.num_tokens[r.row] = r.num_tokens + drafts.size  # scratch, until verified
                self._drafts[r.req_id] = drafts
                num_scheduled[r.req_id] += drafts.size
        for rid, count in ready.items():
            num_scheduled[rid] += count
        return replace(so, num_scheduled_tokens=num_scheduled,
                       total_num_scheduled_tokens=sum(num_scheduled.values()))

    def _forget(self, rid: str) -> None:
        self.num_computed.pop(rid, None)
        self.gate.forget(rid)
        self.device_drafts.forget(rid)
        if self.earlier_stage is not None:
            self.earlier_stage.forget(rid)
        if self.draft_model is not None:
            self.draft_model.forget(rid)

    def _known_tokens(self, so: SchedulerOutput
                      ) -> tuple[dict[str, int], list[DraftRequest]]:
        """Each scheduled request placed from this rank's count, with its known tokens
        only; and the requests that want drafts, with how many the gate lets them have."""
        ib = self.input_batch
        spec = so.scheduled_spec_decode_tokens
        num_scheduled = dict(so.num_scheduled_tokens)
        wanted: list[DraftRequest] = []
        position_cost = step_position_cost(len(num_scheduled), self.step_overhead_tokens)
        for rid, n in so.num_scheduled_tokens.items():
            row = ib.req_id_to_index[rid]
            booked = int(ib.num_computed_tokens[row])
            if self.earlier_stage is not None and not self.earlier_stage.learns_from_ring:
                self.earlier_stage.learn_from_scheduler(rid, booked, int(ib.num_tokens[row]))
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
            num_scheduled[rid] = n - num_booked  # plus the drafts placed in begin_step
            num_wanted = self.gate.num_drafts(rid, num_booked, position_cost)
            if num_wanted:
                wanted.append(DraftRequest(rid, row, num_tokens, num_wanted))
        return num_scheduled, wanted

    def _propose(self, wanted: list[DraftRequest]) -> dict[DraftRequest, np.ndarray]:
        """Drafts proposed at the start of their step, on the host: always on PP stages
        (every stage needs them before its forward), else for requests that have none
        made one step ahead (gate closed or batch too large then, a preemption)."""
        if not wanted:
            return {}
        if self.ngram is not None:
            ib = self.input_batch
            return {r: self.ngram.propose(ib.token_ids[r.row, :r.num_tokens], r.max_drafts).copy()
                    for r in wanted}
        if self.drafts_from_head:
            # A head drafts only at verification, from the step's hidden states; a stage
            # without it places what the last stage's broadcast carried.
            if self.earlier_stage is None:
                return {}
            return {r: d for r in wanted
                    if (d := self.earlier_stage.take_drafts(r.req_id, r.num_tokens,
                                                            r.max_drafts)) is not None}
        assert self.draft_model is not None
        (drafts,) = self.copier.to_host([self.draft_model.propose(wanted)])
        return {r: drafts[i, :r.max_drafts] for i, r in enumerate(wanted)}

    def next_drafts(self, req_ids: list[str]) -> torch.Tensor:
        """Async PP with a head, the last stage: per row of ``req_ids``, the count of its
        drafts for the next step then the drafts (``[rows, 1 + k]``, on the device: no
        host read), sent with the accepted runs."""
        return self.device_drafts.as_columns(req_ids, self.num_spec_tokens)

    def place_device_drafts(self, batch: StepBatch) -> None:
        """After ``InputPreparer.prepare``: the drafts made one step ahead into the inputs."""
        self.device_drafts.place(batch)

    # ---------------------------------------------------------------- last stage
    def take_draft_token_ids(self, req_ids: list[str]) -> DraftTokenIds:
        """This step's drafts of ``req_ids`` (grammar-constrained requests: the grammar
        checks them before ``verify``)."""
        self.device_drafts.to_host(self._drafts)
        return DraftTokenIds(list(req_ids), [
            self._drafts[r].tolist() if r in self._drafts else [] for r in req_ids])

    @torch.inference_mode()
    def verify(self, batch: StepBatch, hidden: torch.Tensor, model: LlamaForCausalLM,
               sampler: Sampler, grammar_output: GrammarOutput | None = None
               ) -> ModelRunnerOutput:
        """Sample every verified position and accept the drafts. ``grammar_output``: the
        bitmask of the step's constrained requests, a row per position they verify."""
        assert self.verifier is not None, "only the last PP stage verifies"
        v = self.verifier.verify(batch, hidden, self._drafts, model, sampler, grammar_output)
        if self.eagle is not None:
            # Every step: the head's KV follows every verified position, drafts or not.
            wanted = (self.draft_ahead.wanted(batch, v.sampling, v.seg_starts, v.base_len)
                      if self.draft_ahead is not None and v.sampled is not None else [])
            drafts = self.eagle.step(batch, hidden, v.sampling, wanted)
            if wanted:
                self.device_drafts.store(wanted, drafts)
        elif self.draft_ahead is not None and v.sampled is not None:
            self._draft_after_verification(batch, v.sampling, v.sampled, v.seg_starts,
                                           v.base_len)
        return v.output

    def _draft_after_verification(self, batch: StepBatch, sampling: np.ndarray,
                                  sampled: torch.Tensor, seg_starts: np.ndarray,
                                  base_len: np.ndarray) -> None:
        # A method of its own so that tests can count the drafting done here.
        assert self.draft_ahead is not None  # verify calls it only with one
        self.draft_ahead.draft(batch, sampling, sampled, seg_starts, base_len)

    # ---------------------------------------------------------------- other PP stages
    def end_step_non_last(self, batch: StepBatch) -> None:
        """A stage that does not sample: this step's drafts leave the history."""
        assert self.earlier_stage is not None, "only a stage that does not sample"
        self.earlier_stage.end_step(batch, self._drafts)

    def receive_verified(self, delivery: RingDelivery | None) -> None:
        """Async PP, a stage that does not sample: the runs accepted pp_size steps ago."""
        assert self.earlier_stage is not None, "only a stage that does not sample"
        self.earlier_stage.receive(delivery)
