"""One rank's model runner: apply the SchedulerOutput diff, prepare inputs, run the model,
and on the last PP stage sample (or verify drafts) and return the result.

Under async scheduling the sampled ids stay on the device for the next step's inputs and
the host copy is awaited only when needed (docs/architecture.md §3 rule 6). Under async PP
the other stages book the same -1 placeholders and take the last stage's broadcast from a
``SampledTokenRing`` pp_size steps later (§4); sync PP needs no ring.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from raylm.parallel.context import ParallelContext
from raylm.runner.async_output import (
    AsyncModelRunnerOutput,
    AsyncOutputCopier,
    build_model_runner_output,
)
from raylm.runner.attention.paged_attention import (
    Attention,
    allocate_kv_cache,
    resolve_attention_backend,
)
from raylm.runner.cuda_graphs import DecodeGraphs, setup_decode_padding
from raylm.runner.input_batch import CachedRequestState, InputBatch
from raylm.runner.kv_transfer.steps import KVConnectorSteps
from raylm.runner.loading.model_loader import get_model, resolve_dtype
from raylm.runner.lora.lora_manager import LoRAManager
from raylm.runner.memory_budget import RankAttentionShape
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.llama import IntermediateTensors, LlamaForCausalLM
from raylm.runner.placeholders import OnHost, PendingPlaceholders, Placeholders
from raylm.runner.pooler import Pooler
from raylm.runner.pp_ring import RingDelivery, SampledTokenRing, SampledTokenTransport
from raylm.runner.prepare_inputs import AsyncInputStats, InputPreparer, StepBatch
from raylm.runner.prompt_results import PromptResults
from raylm.runner.sample.prompt_logprobs import compute_prompt_logprobs
from raylm.runner.sample.sampler import Sampler, SamplerOutput
from raylm.runner.sample.sampling_metadata import build_sampling_metadata
from raylm.runner.spec_decode.speculator import Speculator
from raylm.runner.state_cache import StateSlots
from raylm.runner.structured.grammar_bitmask import DeferredSampling, apply_grammar_bitmask
from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import (
    DraftTokenIds,
    ModelRunnerOutput,
    SchedulerOutput,
)
from raylm.scheduler.structured.manager import GrammarOutput


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, ctx: ParallelContext) -> None:
        self.engine_config = engine_config
        self.ctx = ctx
        self.device = ctx.device
        self.model_config = engine_config.model_config
        self.block_size = engine_config.cache_config.block_size
        self.use_async_scheduling = engine_config.async_scheduling
        self.dtype = resolve_dtype(self.model_config.dtype, self.device,
                                   self.model_config.hf_config)
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = tuple(sorted(self.model_config.eos_token_ids))
        self.requests: dict[str, CachedRequestState] = {}
        sched = engine_config.scheduler_config
        # Layers of different windows read different block tables (kv_cache_groups.py).
        self.kv_cache_groups = engine_config.kv_cache_groups
        self.input_batch = InputBatch(sched.max_num_seqs, self.model_config.max_model_len,
                                      self.block_size, self.kv_cache_groups.num_groups)
        elem = torch.empty((), dtype=self.dtype).element_size()
        decoder = DecoderConfig.from_hf(self.model_config.hf_config)
        attn_shape = RankAttentionShape.of(decoder, ctx.tp_size)
        attention_backend = resolve_attention_backend(self.device)
        self.input_preparer = InputPreparer(
            self.input_batch, self.block_size, sched.max_num_batched_tokens, self.device,
            needs_input_ids=ctx.is_first_pp_rank,
            max_ragged_pairs=attn_shape.max_ragged_pairs(self.block_size, elem),
            attention_backend=attention_backend,
            state_slots_per_request=(1 + engine_config.num_spec_tokens
                                     if decoder.has_state_layers else 0),
            state_snapshot_base=sched.max_num_seqs * (1 + engine_config.num_spec_tokens))
        # Hybrid models: Mamba2 state slots for each request the worker holds.
        self.state_slots = (StateSlots(sched.max_num_seqs, 1 + engine_config.num_spec_tokens)
                            if decoder.has_state_layers else None)
        # Prefix caching of their states: snapshot slots after the requests' slots.
        self.num_state_snapshots = engine_config.num_state_snapshots
        self.max_num_blocks_per_seq = -(-self.model_config.max_model_len // self.block_size)
        # Each sampled request's row in the latest step's sampled ids (every stage books it;
        # the PP layer pairs it with the ids it broadcasts).
        self.sampled_req_id_to_index: dict[str, int] = {}
        self.copier = AsyncOutputCopier(self.device)
        self.pooler = Pooler()
        self._pending = PendingPlaceholders()
        # Async PP, stages that do not sample: the ids come back pp_size steps later. Sync
        # PP with a draft head: its drafts come back so (the runs come from the scheduler).
        spec = engine_config.speculative_config
        head_drafts = spec is not None and spec.reads_target_hidden_states
        self.pp_ring = (SampledTokenRing(ctx.pp_size, sched.max_num_seqs)
                        if (self.use_async_scheduling or head_drafts) and ctx.pp_size > 1
                        and not ctx.is_last_pp_rank else None)
        self.speculator = (Speculator(engine_config, self.input_batch, self.device, self.copier,
                                      is_last_pp_rank=ctx.is_last_pp_rank,
                                      learns_from_ring=(self.pp_ring is not None
                                                        and self.use_async_scheduling))
                           if spec is not None else None)
        self.model: LlamaForCausalLM | None = None
        self.sampler: Sampler | None = None  # the last PP stage's
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = 0
        # Structured outputs: a step whose sampling waits for sample_tokens (last stage).
        self.deferred_sampling: DeferredSampling | None = None
        # Decode steps padded to buckets: replayed as CUDA graphs on a GPU (Triton
        # attention, no PP or drafts: their steps' shapes are not the bucket's), or padded
        # eagerly where asked (RAYLM_PAD_DECODE_STEPS) to check and measure the padding.
        plain = (ctx.pp_size == 1 and self.speculator is None and self.state_slots is None
                 and self.kv_cache_groups.num_groups == 1)
        # Sparse layers: the torch grouping reads the routing on the host; the Triton path
        # (CUDA) does not, but its capture is not yet checked on a GPU: no graphs for them.
        sparse = any(decoder.moe_layers)
        self.use_cuda_graphs = (plain and not sparse and self.device.type == "cuda"
                                and self.input_preparer.attention_backend == "triton"
                                and not self.model_config.enforce_eager)
        self.pad_decode_steps = self.use_cuda_graphs or (plain and envs.pad_decode_steps())
        self.decode_graphs: DecodeGraphs | None = None
        # A KV connector's worker side (offload tier, prefill/decode transfer), driven by
        # the Worker around each step.
        self.kv_steps = KVConnectorSteps.make(engine_config, ctx)
        # LoRA adapters (docs/architecture.md, "LoRA adapters"); the draft model runs without them.
        self.lora = LoRAManager.make(engine_config, self.device,
                                     self.input_preparer.attention_backend)

    # ---------------------------------------------------------------- setup
    def load_model(self, model: LlamaForCausalLM | None = None) -> None:
        """Load from ``model_config.model`` (or take an already built model: tests)."""
        self.model = model if model is not None else get_model(self.model_config, self.ctx)
        if self.lora is not None:
            self.lora.attach(self.model)
        if self.ctx.is_last_pp_rank:
            self.sampler = Sampler(self.vocab_size, self.device)
        if self.speculator is not None:
            self.speculator.load_model(self.ctx, self.model)

    @property
    def loaded_model(self) -> LlamaForCausalLM:
        """The model, once load_model has run."""
        if self.model is None:
            raise RuntimeError("the model is not loaded; call load_model() first.")
        return self.model

    def kv_cache_bytes_per_block(self) -> int:
        draft = self.speculator.kv_cache_bytes_per_block() if self.speculator else 0
        return draft + sum(a.cache_bytes_per_block(self.block_size, self.dtype)
                           for a in self._cache_tensor_layers().values())

    def _cache_tensor_layers(self) -> dict[int, Attention]:
        """This rank's cache tensors, each by the first layer that uses it: one per layer
        with one KV cache group; with several, the layers at one place in their groups
        share one (kv_cache_groups.py), which must hold the same page for each."""
        layers = self.loaded_model.attention_layers
        groups = self.kv_cache_groups
        if groups.num_groups == 1:
            return dict(enumerate(layers))
        first: dict[int, Attention] = {}
        for attn in layers:
            group, tensor = groups.layer_slots[attn.decoder_layer]
            attn.kv_group = group
            other = first.setdefault(tensor, attn)
            if ((other.num_kv_heads, other.head_dim, other.latent_cache)
                    != (attn.num_kv_heads, attn.head_dim, attn.latent_cache)):
                raise ValueError(
                    f"layers {other.decoder_layer} and {attn.decoder_layer} of "
                    f"{self.model_config.model!r} share a KV cache tensor but their pages "
                    f"differ ({other.num_kv_heads} x {other.head_dim} and "
                    f"{attn.num_kv_heads} x {attn.head_dim} KV heads x head_dim).")
        return first

    def state_cache_bytes(self) -> int:
        """The Mamba2 layers' state for every slot (0 without such layers)."""
        if self.state_slots is None:
            return 0
        return (self.state_slots.num_slots + self.num_state_snapshots) * sum(m.state_bytes()
                                                for m in self.loaded_model.state_layers)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        if self.state_slots is not None:
            for mixer in self.loaded_model.state_layers:
                mixer.allocate_state(self.state_slots.num_slots + self.num_state_snapshots)
        self.kv_caches = []
        # Padded rows write and read one more block, which the scheduler never hands out.
        allocated = num_blocks + 1 if self.pad_decode_steps else num_blocks
        tensors = {t: allocate_kv_cache(allocated, self.block_size, attn.num_kv_heads,
                                        attn.head_dim, self.dtype, self.device,
                                        attn.latent_cache)
                   for t, attn in self._cache_tensor_layers().items()}
        groups = self.kv_cache_groups
        for i, attn in enumerate(self.loaded_model.attention_layers):
            cache = tensors[i if groups.num_groups == 1
                            else groups.layer_slots[attn.decoder_layer][1]]
            attn.kv_cache = cache
            self.kv_caches.append(cache)
        if self.speculator is not None:
            self.speculator.initialize_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        if self.kv_steps is not None:
            self.kv_steps.bind(self.kv_caches, self.loaded_model.attention_layers)
        if self.pad_decode_steps:
            model = (self.loaded_model if self.lora is None
                     else self.lora.graph_forward(self.loaded_model))
            self.decode_graphs = setup_decode_padding(
                self.input_preparer, model, self.device,
                self.engine_config.scheduler_config.max_num_seqs,
                self.max_num_blocks_per_seq, scratch_block=num_blocks,
                capture=self.use_cuda_graphs)


    @property
    def async_input_stats(self) -> AsyncInputStats:
        """Counts of slice-copy vs scatter input fills (async scheduling)."""
        return self.input_preparer.stats

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      intermediate_tensors: IntermediateTensors | None = None,
                      pp_transport: SampledTokenTransport | None = None,
                      recv_intermediate: Callable[[SchedulerOutput], IntermediateTensors]
                      | None = None,
                      ) -> (ModelRunnerOutput | AsyncModelRunnerOutput | IntermediateTensors
                            | DraftTokenIds | None):
        """Run one step. The last PP stage returns the step's output (an
        AsyncModelRunnerOutput under async scheduling); other stages return the
        IntermediateTensors to send to the next stage. ``pp_transport`` (async PP) carries
        the sampled ids from the last stage to the others; without it a caller that runs
        the stages itself sets ``prev_sampled_token_ids`` on the earlier stages.
        ``recv_intermediate`` (speculative decoding, not the first stage) receives the
        hidden states once the drafts have fixed the step's size."""
        assert self.deferred_sampling is None, (
            f"step {scheduler_output.step_id} arrived before step "
            f"{self.deferred_sampling.step_id} was sampled (sample_tokens must follow a step "
            "with structured outputs)")
        if scheduler_output.scheduled_spec_decode_tokens and self.speculator is None:
            raise ValueError("scheduled_spec_decode_tokens is not empty but this runner has "
                             "no speculative_config.")
        ring = self.pp_ring if pp_transport is not None else None
        so = self._begin_step(scheduler_output, ring)
        if so.total_num_scheduled_tokens == 0:
            if ring is not None:
                ring.put(None)  # the ring advances on empty steps too
            return ModelRunnerOutput.empty()
        if recv_intermediate is not None:
            intermediate_tensors = recv_intermediate(so)
        batch = self.input_preparer.prepare(so, self._settle_placeholders)
        if self.speculator is not None:
            self.speculator.place_device_drafts(batch)
        if self.lora is not None:
            self.lora.begin_step(self.input_batch.lora_ids[batch.rows], batch.num_scheduled,
                                 int(batch.positions.shape[0]))
        loads = self.kv_steps is not None and self.kv_steps.has_step_loads()
        hidden = (self.decode_graphs.replay(batch.padded_rows)  # graphs skip the layer hooks
                  if batch.padded_rows and self.decode_graphs is not None and not loads
                  else None)
        if hidden is None:
            hidden = self.loaded_model(batch.input_ids, batch.positions, batch.attn_metadata,
                                       intermediate_tensors)
        if not self.ctx.is_last_pp_rank:
            assert isinstance(hidden, IntermediateTensors)  # what a non-last stage returns
            return self._execute_earlier_stage(batch, hidden, ring, pp_transport)
        assert isinstance(hidden, torch.Tensor)  # the last stage's hidden states
        if self.speculator is not None:
            return self._execute_last_stage_speculative(self.speculator, so, batch, hidden,
                                                        pp_transport)
        return self._execute_last_stage(so, batch, hidden, pp_transport)

    def _begin_step(self, so: SchedulerOutput, ring: SampledTokenRing | None
                    ) -> SchedulerOutput:
        """Settle landed copies, apply the diff, then take the ring's delivery: after the
        diff, so a request that left drops its tokens; before drafting and input
        preparation, which read it. Returns the step to prepare (drafts placed)."""
        self._settle_placeholders(block=False)
        self._update_states(so)
        delivery = ring.take() if ring is not None else None
        if self.speculator is None:
            if ring is not None:
                self._receive_sampled_token_ids(delivery)
            return so
        if ring is not None:  # the runs accepted pp_size steps ago, before drafting
            self.speculator.receive_verified(delivery)
        return self.speculator.begin_step(so)  # drafts in, positions from this rank

    def _execute_earlier_stage(self, batch: StepBatch, hidden: IntermediateTensors,
                               ring: SampledTokenRing | None,
                               pp_transport: SampledTokenTransport | None
                               ) -> IntermediateTensors:
        """A stage that does not sample: book what the last stage will sample, post the
        receive of its broadcast (async PP), and hand the hidden states on."""
        if self.speculator is not None:
            # The accepted runs come back whole through the ring: no placeholders.
            self.speculator.end_step_non_last(batch)
            placeholders = None
            self.sampled_req_id_to_index = {
                batch.req_ids[i]: i for i in np.flatnonzero(batch.sample_mask).tolist()}
        else:
            placeholders = self._bookkeeping_non_last(batch)
        if ring is not None and pp_transport is not None:  # a ring only with a transport
            ring.put(pp_transport.recv_sampled_token_ids(batch.num_reqs, self._broadcast_width),
                     self.sampled_req_id_to_index, placeholders)
        return hidden

    def _execute_last_stage(self, so: SchedulerOutput, batch: StepBatch, hidden: torch.Tensor,
                            pp_transport: SampledTokenTransport | None
                            ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """Logits of the sampled positions, then sampling; with a grammar, the logits wait
        for ``sample_tokens`` (its bitmask is not known yet) and the step returns None."""
        logits = self.loaded_model.compute_logits(hidden.index_select(0, batch.logits_indices))
        prompt_results = self._prompt_results(batch, hidden)
        if so.structured_output_request_ids:
            self.deferred_sampling = DeferredSampling(so.step_id, batch, logits, pp_transport,
                                                      prompt_results)
            return None
        return self._sample(batch, logits, pp_transport, prompt_results)

    def _execute_last_stage_speculative(self, speculator: Speculator, so: SchedulerOutput,
                                        batch: StepBatch, hidden: torch.Tensor,
                                        pp_transport: SampledTokenTransport | None
                                        ) -> ModelRunnerOutput | DraftTokenIds:
        """Verify the drafts. With a grammar it checks the drafts first: they go to the
        EngineCore, and the verification waits for ``sample_tokens`` with the bitmask of
        what it kept (the hidden states wait, not logits: which positions are verified
        depends on that)."""
        prompt_results = self._prompt_results(batch, hidden)
        if so.structured_output_request_ids:
            self.deferred_sampling = DeferredSampling(so.step_id, batch, hidden, pp_transport,
                                                      prompt_results)
            return speculator.take_draft_token_ids(so.structured_output_request_ids)
        return self._verify(speculator, batch, hidden, pp_transport, prompt_results)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the deferred step under its grammar bitmask (last PP stage only)."""
        state, self.deferred_sampling = self.deferred_sampling, None
        if state is None:
            raise RuntimeError("sample_tokens without a step waiting for its sampling")
        if self.speculator is not None:
            return self._verify(self.speculator, state.batch, state.logits, state.pp_transport,
                                state.prompt_results, grammar_output)
        apply_grammar_bitmask(state.logits, state.batch.req_ids, grammar_output)
        return self._sample(state.batch, state.logits, state.pp_transport,
                            state.prompt_results)

    def _sample(self, batch: StepBatch, logits: torch.Tensor,
                pp_transport: SampledTokenTransport | None,
                prompt_results: PromptResults,
                ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        md = build_sampling_metadata(self.input_batch, batch, self.vocab_size, self.device,
                                     self._settle_placeholders)
        assert self.sampler is not None  # load_model made it: this is the last stage
        out = self.sampler(logits, md)
        if pp_transport is not None and self.use_async_scheduling and self.ctx.pp_size > 1:
            # Every step that ran the model is broadcast (the other stages posted its
            # receive), non-final prefill chunks' rows included: its size is the batch's.
            pp_transport.broadcast_sampled_token_ids(out.sampled_token_ids)
        return self._bookkeeping(batch, out, prompt_results)

    def _verify(self, speculator: Speculator, batch: StepBatch, hidden: torch.Tensor,
                pp_transport: SampledTokenTransport | None,
                prompt_results: PromptResults,
                grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Verify the drafts and, under async PP, send the accepted runs to the others."""
        assert self.sampler is not None  # load_model made it: this is the last stage
        result = speculator.verify(batch, hidden, self.loaded_model, self.sampler,
                                   grammar_output)
        prompt_results.attach(result)
        self._broadcast_verified(result, pp_transport)
        return result

    @property
    def _broadcast_width(self) -> int:
        """Columns of a step's broadcast: the sampled id, or with speculative decoding the
        count of emitted tokens and up to 1 + k of them."""
        k = self.engine_config.num_spec_tokens
        if self.speculator is None:
            return 1
        return 3 + 2 * k if self.speculator.drafts_from_head else 2 + k

    def _broadcast_verified(self, result: ModelRunnerOutput,
                            pp_transport: SampledTokenTransport | None) -> None:
        """Async PP with speculative decoding: send every row's accepted run (the earlier
        stages need it in their history to draft and place the request's next step).
        Sync PP with a draft head: the same message, for the head's drafts."""
        speculator = self.speculator
        head = speculator is not None and speculator.drafts_from_head
        if pp_transport is None or self.ctx.pp_size == 1 or not (self.use_async_scheduling
                                                                 or head):
            return
        k = self.engine_config.num_spec_tokens
        runs = np.full((len(result.req_ids), 2 + k), -1, np.int64)
        for i, tokens in enumerate(result.sampled_token_ids):
            runs[i, 0] = len(tokens)
            runs[i, 1:1 + len(tokens)] = tokens
        sent = torch.from_numpy(runs).to(self.device)
        if speculator is not None and head:
            # The head's drafts for each request's next step ride along, still on the device.
            sent = torch.cat((sent, speculator.next_drafts(list(result.req_ids))), dim=1)
        pp_transport.broadcast_sampled_token_ids(sent)

    def _prompt_results(self, batch: StepBatch, hidden: torch.Tensor) -> PromptResults:
        """What the step's prompt positions give besides sampling: prompt logprobs and
        embeddings."""
        states = [self.input_batch.states[r] for r in batch.rows.tolist()]
        results = PromptResults()
        num_computed = batch.seq_lens - batch.num_scheduled
        if any(s.sampling_params.prompt_logprobs is not None for s in states):
            results.logprobs = compute_prompt_logprobs(
                self.loaded_model.compute_logits, hidden, batch.req_ids, states, num_computed,
                batch.num_scheduled)
        if any(s.sampling_params.pooling is not None for s in states):
            results.pooled = self.pooler.pool(hidden, batch.req_ids, states, num_computed,
                                              batch.num_scheduled)
        return results

    def _receive_sampled_token_ids(self, delivery: RingDelivery | None) -> None:
        """Async PP, a stage that does not sample: the ids broadcast pp_size steps ago
        become the previous step's ids for input preparation (the device path), and their
        host copy settles this stage's placeholders (needed only by a request that waited
        more than pp_size steps to decode again)."""
        ib = self.input_batch
        if delivery is None:
            ib.prev_sampled_token_ids = None
            ib.prev_req_id_to_index = {}
            return
        sampled = delivery.pending.wait().view(-1, 1)
        ib.prev_sampled_token_ids = sampled
        ib.prev_req_id_to_index = delivery.req_id_to_index
        ph: Placeholders = delivery.payload
        keep = delivery.keep
        if keep.any():
            copy = (OnHost(sampled) if sampled.device.type == "cpu"
                    else self.copier.start([sampled]))
            self._pending.add(copy, ph.kept(keep))

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        gone = so.finished_req_ids | so.preempted_req_ids
        for new in so.scheduled_new_reqs:
            if new.req_id in self.requests:
                gone = gone | {new.req_id}  # re-sent (resumed): rebuild from scratch
        # Hazard: a request finished or preempted while a step that sampled for it was in
        # flight. Dropping its state is safe: that step's placeholder is settled only
        # through ``state.row``, which becomes None here.
        self.pooler.drop(so.finished_req_ids)
        for req_id in gone:
            self.requests.pop(req_id, None)
            if self.pp_ring is not None:
                self.pp_ring.remove_request(req_id)
            if self.state_slots is not None:
                self.state_slots.release(req_id)
        ib.remove_requests(gone)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            stop_ids = tuple(sorted(set(sp.stop_token_ids) | (
                set() if sp.ignore_eos else set(self.eos_token_ids))))
            new_state = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=sp, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, seed=new.sampling_seed,
                output_token_ids=list(new.output_token_ids), min_tokens_stop_ids=stop_ids,
                lora_request=new.lora_request)
            if self.state_slots is not None:
                new_state.state_group = self.state_slots.assign(new.req_id)
                new_state.state_snapshot = new.state_snapshot
            if self.lora is not None:
                self.lora.add_request(new.lora_request)
            self.requests[new.req_id] = new_state
            ib.add_request(new_state)
            if self.pp_ring is not None:
                self.pp_ring.add_request(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                raise ValueError(f"cached request {req_id!r} is unknown to the worker.")
            row = state.row
            assert row is not None  # a request the worker holds has a row in the batch
            state.num_computed_tokens = cached.num_computed_tokens[i]
            ib.num_computed_tokens[row] = state.num_computed_tokens
            if cached.new_block_ids[i]:
                state.block_ids.extend(cached.new_block_ids[i])
                ib.append_block_ids(row, cached.new_block_ids[i])
            if cached.new_token_ids and cached.new_token_ids[i]:
                # The scheduler's ids for this step's inputs that are outputs (sync PP),
                # from k tokens earlier with speculative decoding (the accepted drafts).
                start = max(state.num_computed_tokens - self.engine_config.num_spec_tokens,
                            state.num_prompt_tokens)
                ib.receive_tokens(row, start, cached.new_token_ids[i])

    def _bookkeeping(self, batch: StepBatch, out: SamplerOutput,
                     prompt_results: PromptResults,
                     ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        ib = self.input_batch
        sampled = out.sampled_token_ids  # [B, 1]
        lp = out.logprobs_tensors
        tensors = [sampled]
        if lp is not None:
            tensors += [lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks]
        valid = np.flatnonzero(batch.sample_mask)  # non-final prefill chunks are discarded
        rows_valid = batch.rows[valid]
        req_id_to_index = {r: i for i, r in enumerate(batch.req_ids)}
        num_logprobs = ib.num_logprobs[batch.rows]
        if not self.use_async_scheduling:
            host = [t.cpu().numpy() for t in tensors]  # the sync point of sync mode
            ib.append_sampled(rows_valid, host[0][valid, 0])
            result = build_model_runner_output(batch.req_ids, req_id_to_index, batch.sample_mask,
                                               host[0][:, 0], num_logprobs,
                                               host[1:] if lp is not None else None)
            prompt_results.attach(result)
            return result
        copy = self.copier.start(tensors)
        positions = ib.append_sampled(rows_valid, None)
        self.sampled_req_id_to_index = {batch.req_ids[i]: i for i in valid.tolist()}
        ib.prev_sampled_token_ids = sampled
        ib.prev_req_id_to_index = self.sampled_req_id_to_index
        self._pending.add(copy, Placeholders([ib.states[r] for r in rows_valid.tolist()],
                                             positions, valid))
        return AsyncModelRunnerOutput(batch.req_ids, req_id_to_index, batch.sample_mask,
                                      num_logprobs, copy, has_logprobs=lp is not None,
                                      prompt_logprobs_dict=prompt_results.logprobs,
                                      pooled_dict=prompt_results.pooled)

    def _bookkeeping_non_last(self, batch: StepBatch) -> Placeholders | None:
        """A stage that does not sample: under async scheduling it books placeholders
        exactly as the last stage does and returns them; the ids themselves arrive from
        the last stage (the ring sets ``input_batch.prev_sampled_token_ids`` and
        ``prev_req_id_to_index`` pp_size steps later; a caller running the stages back to
        back sets the ids itself). In sync mode they come in
        ``CachedRequestData.new_token_ids``."""
        if not self.use_async_scheduling:
            return None
        valid = np.flatnonzero(batch.sample_mask)
        rows_valid = batch.rows[valid]
        positions = self.input_batch.append_sampled(rows_valid, None)
        self.sampled_req_id_to_index = {batch.req_ids[i]: i for i in valid.tolist()}
        self.input_batch.prev_req_id_to_index = self.sampled_req_id_to_index
        return Placeholders([self.input_batch.states[r] for r in rows_valid.tolist()],
                            positions, valid)

    def _settle_placeholders(self, block: bool = True) -> None:
        """Write the real ids of earlier async steps over their -1 placeholders."""
        self._pending.settle(self.input_batch.token_ids, block)

    def shutdown(self) -> None:
        self.copier.shutdown()
        self._pending.clear()
        if self.kv_steps is not None:
            self.kv_steps.shutdown()
