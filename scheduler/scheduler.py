"""The Scheduler (vLLM V1): one token budget, no prefill/decode phases.

Each ``schedule()`` gives every RUNNING request the tokens it still lacks (chunked by the
budget), preempting the newest running request when KV blocks run out, then admits WAITING
requests (prefix-cache hits, KV a connector loads, chunked prefill). It owns three
collaborators, a ``StepSettler`` for returned steps, ``StructuredOutputScheduling`` for
grammars and ``KVTransferScheduling`` for KV loaded from outside (or sent out); the
ledger's rules are async_ledger.py's. AsyncScheduler adds only the output placeholders and
the PP cadence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

from raylm.scheduler.async_ledger import (
    book_scheduled_tokens,
    in_flight_steps_yield_all_tokens,
    reset_on_preemption,
)
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from raylm.scheduler.kv.block_pool import KVCacheBlock
from raylm.scheduler.kv.kv_cache_manager import KVCacheManager
from raylm.scheduler.kv.kv_cache_utils import update_block_hashes
from raylm.scheduler.kv.state_snapshots import StateSnapshots
from raylm.scheduler.kv_transfer.factory import make_connector_scheduler
from raylm.scheduler.kv_transfer.kv_transfer_scheduling import KVTransferScheduling
from raylm.scheduler.lora import LoRAAdmission, lora_requests_info
from raylm.scheduler.request import InvalidRequestError, Request, RequestStatus
from raylm.scheduler.scheduler_checks import check_scheduler_integrity
from raylm.scheduler.scheduler_stats import SchedulerCounters
from raylm.scheduler.scheduler_update import StepSettler
from raylm.scheduler.spec_decode_stats import SpecDecodingCounters, num_useful_drafts
from raylm.scheduler.step_plan import StepPlan, make_scheduler_output
from raylm.scheduler.structured.manager import StructuredOutputManager
from raylm.scheduler.structured.structured_output_scheduling import StructuredOutputScheduling


class Scheduler:
    #: Whether decodes book output placeholders (async scheduling).
    books_output_placeholders = False

    def __init__(self, config: EngineConfig, num_kv_blocks: int,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.max_num_running_reqs = config.scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_model_len = config.model_config.max_model_len
        self.block_size = config.cache_config.block_size
        self.enable_caching = config.cache_config.enable_prefix_caching
        spec = config.speculative_config
        self.kv_cache_manager = KVCacheManager(
            self.block_size, num_kv_blocks, self.enable_caching, config.kv_cache_groups.windows,
            drop_last_hit_block=spec is not None and spec.reads_target_hidden_states)
        # Hybrid models with prefix caching: the recurrent states' snapshots by block.
        self.state_snapshots = (StateSnapshots(config.num_state_snapshots)
                                if config.num_state_snapshots else None)
        self.requests: dict[str, Request] = {}  # unfinished requests only
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(): the workers must drop their state.
        self.finished_req_ids: set[str] = set()
        self.current_step = 0
        # Sync PP: earlier stages never see sampled ids unless the scheduler sends them
        # (async PP broadcasts them stage to stage instead).
        self.send_sampled_token_ids = (config.parallel_config.pipeline_parallel_size > 1
                                       and not self.books_output_placeholders)
        self.counters = SchedulerCounters()
        # Speculative decoding: every decode books k draft positions as -1 placeholders
        # in both modes; the workers propose the drafts and write them over these
        # (shared, read-only list).
        self.num_spec_tokens = config.num_spec_tokens
        # 1 autoregressively; 0 for a diffusion model (its steps return a canvas, no
        # bonus token): the max_model_len clamp and the async booking read it.
        self.num_sampled_tokens_per_step = config.model_config.num_sampled_tokens_per_step
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens
        self.spec_decode_counters = SpecDecodingCounters(self.num_spec_tokens)
        self._stats_snapshot = (0, 0, 0)
        # LoRA: a step holds requests of at most this many distinct adapters (the workers'
        # device slots); None without LoRA.
        lora = config.lora_config
        self.max_loras = lora.max_loras if lora is not None else None
        kv = self.kv_cache_manager
        # The collaborators read the requests through a read-only view; only this class
        # adds, removes and queues them.
        requests_view = MappingProxyType(self.requests)
        self.kv_transfer = KVTransferScheduling(
            make_connector_scheduler(config, kv.get_block_ids), kv_cache_manager=kv,
            block_size=self.block_size)
        self.structured_output = StructuredOutputScheduling(
            requests=requests_view, manager=structured_output_manager,
            num_spec_tokens=self.num_spec_tokens,
            books_output_placeholders=self.books_output_placeholders,
            finish_request=self._finish_request)
        self.step_settler = self._make_step_settler(
            requests=requests_view, kv_cache_manager=self.kv_cache_manager,
            counters=self.counters, spec_decode_counters=self.spec_decode_counters,
            finish_request=self._finish_request,
            advance_grammar=self.structured_output.advance_grammar,
            max_model_len=self.max_model_len, block_size=self.block_size,
            enable_caching=self.enable_caching,
            books_output_placeholders=self.books_output_placeholders,
            kv_transfer=self.kv_transfer)

    def _make_step_settler(self, **collaborators: Any) -> StepSettler:
        return StepSettler(**collaborators)

    @property
    def structured_output_manager(self) -> StructuredOutputManager | None:
        return self.structured_output.manager

    @property
    def waiting_for_fsm(self) -> list[Request]:
        """Constrained requests whose grammar still compiles (WAITING_FOR_FSM)."""
        return self.structured_output.waiting_for_fsm

    # ---- requests in and out -------------------------------------------------------
    def validate_request(self, request: Request) -> None:
        """Raise ValueError if the request can never be served. Reads only immutable state."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use.")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt {request.num_prompt_tokens} + "
                f"max_tokens {request.max_tokens} exceeds max_model_len={self.max_model_len}.")
        needed = self.config.kv_blocks_per_request(
            min(total + self.num_lookahead_tokens, self.max_model_len))
        if needed > self.kv_cache_manager.num_blocks:
            drafts = (f" + {self.num_lookahead_tokens} draft slots" if self.num_lookahead_tokens
                      else "")
            raise InvalidRequestError(
                f"request {request.request_id!r} needs {needed} KV blocks (prompt "
                f"{request.num_prompt_tokens} + max_tokens {request.max_tokens} tokens{drafts}) "
                f"but the pool holds only {self.kv_cache_manager.num_blocks}.")
        if request.lora_request is not None and self.max_loras is None:
            raise InvalidRequestError(
                f"request {request.request_id!r} names LoRA adapter "
                f"{request.lora_request.lora_name!r} but this engine runs without LoRA "
                "(enable_lora=False).", "model")
        self.structured_output.validate_request(request)

    def add_request(self, request: Request) -> None:
        self.validate_request(request)
        if self.enable_caching:
            update_block_hashes(request, self.block_size)
        self.requests[request.request_id] = request
        if not self._add_structured_output_request(request):
            self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> list[EngineCoreOutput]:
        """Finish requests from outside (abort). Returns each one's final output, at once.

        Unknown or already finished ids are ignored, so a request gets exactly one final
        output. A step still in flight for it is skipped when it returns (§3 rule 5); its
        blocks are freed behind that step's fence.
        """
        assert RequestStatus.is_finished(finished_status), finished_status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        outputs = []
        removed_running: set[str] = set()
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                removed_running.add(rid)
            elif request.status == RequestStatus.WAITING_FOR_FSM:
                self.waiting_for_fsm.remove(request)
            elif request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting.remove(request)
            request.status = finished_status
            outputs.append(self._finish_request(request, []))
        if removed_running:
            self.running = [r for r in self.running if r.request_id not in removed_running]
        return outputs

    def admit_structured_output_requests(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar is ready (arrival order); the final outputs of
        those whose grammar failed to compile."""
        ready, outputs = self.structured_output.take_compiled()
        self.waiting.extend(ready)
        return outputs

    def _add_structured_output_request(self, request: Request) -> bool:
        """Park a constrained request until its grammar is compiled. True if parked."""
        return self.structured_output.add_request(request)

    def _finish_request(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        """Free a finished request (its blocks behind their fence, §3 rule 5) and return
        its final output. The caller has set its finished status."""
        output = EngineCoreOutput(
            request.request_id, new_token_ids, finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0))
        # A KV connector may hold the blocks for a transfer still under way.
        delay_free, output.kv_transfer_params = self.kv_transfer.request_finished(request)
        if not delay_free:
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.counters.num_requests_finished += 1
        return output

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = self._begin_step()
        plan = StepPlan(budget=self.max_num_scheduled_tokens)
        if self.kv_transfer.received:
            self.waiting.extendleft(self.kv_transfer.admit_received())
        self._schedule_running(step, plan)
        new_reqs: list[Request] = []
        if not plan.preempted and not plan.blocked_on_kv:
            new_reqs = self._schedule_waiting(plan)
        out = make_scheduler_output(
            step, plan, new_reqs + plan.resent, self.finished_req_ids,
            self.kv_cache_manager.get_block_ids,
            self.num_spec_tokens if self.send_sampled_token_ids else None)
        self.finished_req_ids = set()
        self.kv_transfer.build_meta(out, self.requests)
        if self.state_snapshots is not None:
            self._plan_state_saves(out)
        self._update_after_schedule(out)
        return out

    def _plan_state_saves(self, out: SchedulerOutput) -> None:
        """A prefill chunk saves the state at the block boundary it ends on ("align"), or
        at every one it passes ("all"), each block's at most once, so later requests with
        that prefix start from it."""
        snapshots = self.state_snapshots
        assert snapshots is not None  # only called with them
        bs = self.block_size
        every_boundary = self.config.cache_config.mamba_cache_mode == "all"
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests[rid]
            start = request.num_computed_tokens
            # Prompt tokens whose hashes are known: a boundary past them is not saved.
            last = min(start + n, request.num_prompt_tokens, len(request.block_hashes) * bs)
            first = start + 1 if every_boundary else start + n
            saves = []
            for end in range(-(-first // bs) * bs, last + 1, bs):
                block_hash = request.block_hashes[end // bs - 1]
                if snapshots.wants(block_hash):
                    slot = snapshots.reserve(out.step_id, block_hash)
                    if slot >= 0:
                        saves.append((end, slot))
            if saves:
                out.state_snapshot_saves[rid] = saves

    def _aligned(self, request: Request, computed: int, num_new: int) -> int:
        """Hybrid models with prefix caching: a prefill chunk from ``computed`` ends at a
        block boundary where it can (the prompt's last full block included, its tail the
        next step), so the state there can be saved (vLLM's "align" mode)."""
        prompt = request.num_prompt_tokens
        if (self.state_snapshots is None or computed >= prompt
                or self.config.cache_config.mamba_cache_mode != "align"):
            return num_new
        boundary = min(computed + num_new, prompt) // self.block_size * self.block_size
        return boundary - computed if boundary > computed else num_new

    def _begin_step(self) -> int:
        self.current_step += 1
        self.counters.num_steps += 1
        self.kv_cache_manager.begin_step(self.current_step)
        return self.current_step

    def _schedule_running(self, step: int, plan: StepPlan) -> None:
        """Give each RUNNING request the tokens it lacks, oldest first, preempting the
        newest when KV blocks run out."""
        running = self.running
        resend = self.kv_transfer.needs_resend
        i = 0
        while i < len(running) and plan.budget > 0:
            request = running[i]
            i += 1
            num_new = self._num_new_running_tokens(request, step, plan.budget)
            if num_new <= 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, plan)
            if new_blocks is None:
                continue
            drafts = self._scheduled_drafts(request, num_new)
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
            if resend and request.request_id in resend:
                # A failed KV load rolled it back: the workers drop their state of it
                # (listed as preempted) and rebuild it from the full request.
                resend.discard(request.request_id)
                plan.resent.append(request)
            else:
                plan.cached.append((request, [b.block_id for b in new_blocks]))
            plan.num_scheduled_tokens[request.request_id] = num_new
            plan.budget -= num_new

    def _scheduled_drafts(self, request: Request, num_new: int) -> list[int]:
        """The drafts among a running request's ``num_new`` scheduled tokens (after its
        known tokens and placeholders)."""
        num_spec = (num_new + request.num_computed_tokens - request.num_tokens
                    - request.num_output_placeholders)
        return request.spec_token_ids[:num_spec] if num_spec > 0 else []

    def _with_first_drafts(self, request: Request, computed: int, num_new: int,
                           budget: int) -> int:
        """A waiting request's first step: its ``num_new`` prompt tokens (drafts come
        from the step after)."""
        return num_new

    def _num_new_running_tokens(self, request: Request, step: int, budget: int) -> int:
        """Tokens to schedule for a running request this step (0: skip it)."""
        if in_flight_steps_yield_all_tokens(request):  # §3 rule 2
            return 0
        if step < request.next_decode_eligible_step:  # PP decode cadence
            return 0
        computed = request.num_computed_tokens
        if request.num_tokens + request.num_output_placeholders <= computed:
            # Sync PP: its last token is still in flight. Drafts alone are no step: they
            # follow that token.
            return 0
        num_new = min(request.num_tokens_with_spec + request.num_output_placeholders - computed,
                      budget, self.max_model_len - self.num_sampled_tokens_per_step - computed)
        num_spec = num_new + computed - request.num_tokens - request.num_output_placeholders
        if num_spec > 0:
            num_new -= max(num_spec - num_useful_drafts(request), 0)
        return self._aligned(request, computed, num_new)

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             plan: StepPlan) -> list[KVCacheBlock] | None:
        """KV slots for ``num_new`` more tokens, preempting the newest running requests
        until they fit. None: not this step (the request itself was preempted, or blocks
        freed behind an in-flight step's fence will cover it soon)."""
        kv = self.kv_cache_manager
        running = self.running
        lookahead = self._lookahead(request.num_computed_tokens, num_new)
        new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
        while new_blocks is None:
            if self.kv_transfer.loaded and self.kv_transfer.reclaim_loaded(self.waiting):
                new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                continue
            if kv.num_deferred_blocks and kv.get_num_blocks_to_allocate(
                    request, num_new, num_lookahead_tokens=lookahead) <= (
                    kv.block_pool.get_num_free_blocks() + kv.num_deferred_blocks):
                # Blocks freed behind an in-flight step's fence will cover it: wait
                # for them instead of preempting (preempted blocks would be deferred too).
                plan.blocked_on_kv = True
                return None
            victim = running.pop()
            self._preempt_request(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None
            new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
        return new_blocks

    def _lookahead(self, num_computed: int, num_new: int) -> int:
        """Slots a draft model writes past a step's tokens (``num_lookahead_tokens``),
        within max_model_len."""
        return max(min(self.num_lookahead_tokens, self.max_model_len - num_computed - num_new), 0)

    def _schedule_waiting(self, plan: StepPlan) -> list[Request]:
        budget, num_scheduled_tokens = plan.budget, plan.num_scheduled_tokens
        kv = self.kv_cache_manager
        kv_transfer = self.kv_transfer
        scheduled: list[Request] = []
        # LoRA: requests whose adapter would exceed max_loras wait, in order, in front.
        skipped: list[Request] = []
        loras = LoRAAdmission(self.running, self.max_loras) if self.max_loras is not None \
            else None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_running_reqs:
            request = self.waiting[0]
            if loras is not None and not loras.admits(request):
                skipped.append(self.waiting.popleft())
                continue
            num_external, load_async = 0, False
            hit_blocks: list[KVCacheBlock]
            if kv_transfer.holds_blocks(request):  # its KV was loaded from outside
                hit_blocks, num_hit = [], request.num_computed_tokens
            else:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                if self.state_snapshots is not None:  # a hit needs the state where it ends
                    num_blocks, request.state_snapshot = self.state_snapshots.longest_hit(
                        request.block_hashes, num_hit // self.block_size)
                    hit_blocks = hit_blocks[:num_blocks * kv.num_groups]
                    num_hit = num_blocks * self.block_size
                num_external, load_async = kv_transfer.match(request, num_hit)
            # Loaded tokens cost no budget; an asynchronous load computes nothing yet.
            num_new = 0 if load_async else min(request.num_tokens - num_hit - num_external,
                                               budget)  # chunked prefill
            num_new = self._aligned(request, num_hit + num_external, num_new)
            if not load_async:
                num_new = self._with_first_drafts(request, num_hit + num_external, num_new,
                                                  budget)
            if kv.allocate_slots(request, num_new + num_external, hit_blocks,
                                 self._lookahead(num_hit, num_new + num_external)) is None:
                if kv_transfer.loaded and kv_transfer.reclaim_loaded(self.waiting,
                                                                     exclude=request):
                    continue  # retry with what a loaded request held (see reclaim_loaded)
                break
            self.waiting.popleft()
            kv.record_prefix_cache_query(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit + num_external
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit + num_external
            kv_transfer.after_alloc(request, num_hit, num_external, load_async)
            if load_async:
                continue  # WAITING_FOR_REMOTE_KVS: not in the running batch
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(request)
            num_scheduled_tokens[request.request_id] = num_new
            drafts = self._scheduled_drafts(request, num_new)
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
            budget -= num_new
            if loras is not None:
                loras.admitted(request)
        self.waiting.extendleft(reversed(skipped))
        return scheduled

    def _preempt_request(self, request: Request) -> None:
        """Recompute preemption. Resets the ledger (§3 rule 4): results of its in-flight
        steps become stale and will be drained, never appended."""
        self.kv_cache_manager.free(request)
        self.kv_transfer.forget(request)
        request.status = RequestStatus.PREEMPTED
        reset_on_preemption(request)
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Book the step on each scheduled request's ledger (§3 rule 1)."""
        requests = self.requests
        spec_placeholders = self._spec_token_placeholders
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            book_scheduled_tokens(requests[rid], n, spec_placeholders)

    # ---- queries -------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_requests(self) -> bool:
        """Unfinished requests, finished ones whose worker state is still to drop, or a KV
        connector's orders for the workers."""
        return (bool(self.requests) or bool(self.finished_req_ids)
                or self.kv_transfer.has_pending_work())

    def make_stats(self) -> SchedulerStats:
        """Gauges, and counter deltas since the previous call (update_from_output's)."""
        kv = self.kv_cache_manager
        now = (self.counters.num_preemptions, kv.prefix_cache_queries, kv.prefix_cache_hits)
        last, self._stats_snapshot = self._stats_snapshot, now
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage, num_preemptions=now[0] - last[0],
            prefix_cache_queries=now[1] - last[1], prefix_cache_hits=now[2] - last[2])

    # ---- results -------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Settle a returned step (the StepSettler) and emit its outputs with the stats."""
        outputs, any_stopped = self.step_settler.settle(scheduler_output, model_runner_output)
        if self.state_snapshots is not None:
            self.state_snapshots.on_step_processed(scheduler_output.step_id)
        if any_stopped:
            self.running = [r for r in self.running if not r.is_finished()]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def lora_metrics(self) -> dict[str, float]:
        """``lora_requests_info`` (vLLM's): the running and waiting adapters; none without
        LoRA."""
        if self.max_loras is None:
            return {}
        return lora_requests_info(self.running, self.waiting, self.max_loras)

    def check_integrity(self, no_steps_in_flight: bool = False) -> None:
        """Pool invariants and per-request ledger sanity; stricter with nothing in flight."""
        check_scheduler_integrity(self.kv_cache_manager, self.requests, self.waiting,
                                  self.running, self.waiting_for_fsm, no_steps_in_flight,
                                  self.kv_transfer)
        if self.state_snapshots is not None:
            self.state_snapshots.check_integrity()
