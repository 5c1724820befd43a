"""StepSettler: settles one returned step against the ledger (``update_from_output``).

Steps return in the order they were scheduled, but under async scheduling later steps are
already booked when a result arrives. The Scheduler owns one settler and hands it the
state it touches; the ledger's arithmetic is in async_ledger.py. Hazards, where handled
here: a request finished or aborted meanwhile (docs/architecture.md §3 rule 5), results
that predate a preemption (rule 4), rejected drafts (rule 3), tokens past a stop (rule 1),
and KV that failed to load from outside (§3 rule 9): the tokens a
step computed on it are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from raylm.scheduler.async_ledger import (
    roll_back_rejected_drafts,
    roll_back_trimmed_tokens,
    settle_in_flight_tokens,
    settle_output_placeholders,
)
from raylm.scheduler.core_outputs import (
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from raylm.scheduler.kv.kv_cache_manager import KVCacheManager
from raylm.scheduler.kv.kv_cache_utils import update_block_hashes
from raylm.scheduler.kv_transfer.kv_transfer_scheduling import KVTransferScheduling
from raylm.scheduler.prompt_logprobs import take_new_prompt_logprobs
from raylm.scheduler.request import Request
from raylm.scheduler.scheduler_stats import SchedulerCounters
from raylm.scheduler.spec_decode_stats import SpecDecodingCounters
from raylm.scheduler.stop import check_stop


def _slice_logprobs(lp: LogprobsLists | None, n: int) -> LogprobsLists | None:
    if lp is None or len(lp.token_ids) <= n:
        return lp
    return LogprobsLists(lp.token_ids[:n], lp.logprobs[:n], lp.sampled_token_ranks[:n])


class StepSettler:
    #: Whether a returned token's KV is computed (an accepted draft's): a diffusion
    #: model's committed canvas is encoded by a later step.
    outputs_are_computed = True

    def __init__(self, *, requests: Mapping[str, Request], kv_cache_manager: KVCacheManager,
                 counters: SchedulerCounters, spec_decode_counters: SpecDecodingCounters,
                 finish_request: Callable[[Request, list[int]], EngineCoreOutput],
                 advance_grammar: Callable[[Request, list[int]], int],
                 max_model_len: int, block_size: int, enable_caching: bool,
                 books_output_placeholders: bool, kv_transfer: KVTransferScheduling) -> None:
        self.requests = requests
        self.kv_cache_manager = kv_cache_manager
        self.counters = counters
        self.spec_decode_counters = spec_decode_counters
        self.finish_request = finish_request  # frees it, returns its final output
        self.advance_grammar = advance_grammar  # how many settled tokens its grammar keeps
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.books_output_placeholders = books_output_placeholders
        self.kv_transfer = kv_transfer

    def settle(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
               ) -> tuple[list[EngineCoreOutput], bool]:
        """Apply a returned step: the outputs to emit, and whether a request stopped (it
        is freed here; the caller drops it from its running queue)."""
        requests = self.requests
        kv = self.kv_cache_manager
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        all_logprobs = model_runner_output.logprobs
        spec = scheduler_output.scheduled_spec_decode_tokens
        step_id = scheduler_output.step_id
        outputs: list[EngineCoreOutput] = []
        any_stopped = False
        # Requests whose KV failed to load, each with the tokens it keeps.
        failed = self.kv_transfer.on_step_output(model_runner_output.kv_connector_output,
                                                 requests)
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.is_finished():
                # Finished or aborted while this step was in flight: its final output is
                # out and its blocks wait behind this step's fence. Nothing to settle.
                continue
            if settle_in_flight_tokens(request, num_scheduled, step_id):
                failed.pop(rid, None)
                continue  # scheduled before a preemption reset the ledger
            if rid in failed:
                # Computed on KV that failed to load: its tokens are garbage.
                self.kv_transfer.roll_back(request, failed.pop(rid))
                continue
            i = index.get(rid)
            generated = sampled[i] if i is not None else []
            drafts = spec.get(rid) if spec else None
            if drafts:
                proposed = model_runner_output.num_draft_tokens
                self._settle_drafts(request, generated, drafts, step_id,
                                    len(drafts) if proposed is None or i is None
                                    else proposed[i])
            new_token_ids, stopped = self._append_output_tokens(request, generated)
            if request.use_structured_output and new_token_ids:
                new_token_ids = new_token_ids[:self.advance_grammar(request, new_token_ids)]
                stopped = stopped or request.is_finished()
            # KV of tokens whose steps have all returned is settled: cache its full blocks.
            kv.cache_blocks(request, self._num_settled_tokens(request))
            prompt_lp = take_new_prompt_logprobs(
                request, model_runner_output.prompt_logprobs_dict.get(rid))
            if not new_token_ids and not stopped and prompt_lp is None:
                continue
            lp = all_logprobs[i] if all_logprobs is not None and i is not None else None
            if stopped:
                any_stopped = True
                out = self.finish_request(request, new_token_ids)
            else:
                out = EngineCoreOutput(rid, new_token_ids,
                                       num_cached_tokens=max(request.num_cached_tokens, 0))
            out.new_logprobs = _slice_logprobs(lp, len(new_token_ids))
            out.new_prompt_logprobs = prompt_lp
            out.pooled = model_runner_output.pooled_dict.get(rid)
            outputs.append(out)
        for rid, num_good in failed.items():  # not in this step (waiting for their load)
            self.kv_transfer.roll_back(requests[rid], num_good)
        kv.on_step_processed(step_id)
        return outputs, any_stopped

    def _settle_drafts(self, request: Request, generated: list[int], drafts: list[int],
                       step_id: int, num_proposed: int) -> None:
        """Drafts the runner rejected leave the ledger (§3 rule 3); the rest are counted."""
        num_accepted = max(len(generated) - 1, 0)
        num_rejected = len(drafts) - num_accepted
        assert num_rejected >= 0, (
            f"{request.request_id}: {len(generated)} tokens back for {len(drafts)} drafts")
        if num_rejected > 0:
            roll_back_rejected_drafts(request, num_rejected, self.books_output_placeholders)
        self.spec_decode_counters.observe(num_proposed, num_accepted)

    def _num_settled_tokens(self, request: Request) -> int:
        """Tokens whose KV no step in flight still writes."""
        return request.num_computed_tokens - request.num_in_flight_tokens

    def _append_output_tokens(self, request: Request, generated: list[int]
                              ) -> tuple[list[int], bool]:
        """Append tokens one at a time until a stop; returns the kept ones."""
        num_new = len(generated)
        if num_new == 0:
            return [], False
        first_output = request.num_output_tokens == 0
        kept = list(generated)  # the runner's list stays the runner's
        stopped = False
        for n, token_id in enumerate(generated, 1):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len):
                stopped = True
                if n < num_new:
                    if self.outputs_are_computed:
                        roll_back_trimmed_tokens(request, num_new - n)
                    kept = generated[:n]
                break
        if self.books_output_placeholders:
            settle_output_placeholders(request, num_new)
        self.counters.generation_tokens += len(kept)
        if first_output:
            self.counters.prompt_tokens += request.num_prompt_tokens
        if self.enable_caching:
            update_block_hashes(request, self.block_size)
        return kept, stopped
