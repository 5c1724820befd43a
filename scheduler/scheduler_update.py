"""Scheduler.update_from_output: settle one step's results against the ledger.

Steps return in the order they were scheduled, but under async scheduling one or more
later steps are already booked when a result arrives. Each hazard is handled where it
occurs: a request finished or aborted meanwhile (§3 rule 5), results that predate a
preemption (§3 rule 4), rejected drafts (§3 rule 3), tokens past a stop (§3 rule 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raylm.scheduler.core_outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from raylm.scheduler.kv.kv_cache_utils import update_block_hashes
from raylm.scheduler.prompt_logprobs import take_new_prompt_logprobs
from raylm.scheduler.stop import check_stop

if TYPE_CHECKING:
    from raylm.scheduler.request import Request
    from raylm.scheduler.scheduler import Scheduler


def _slice_logprobs(lp: LogprobsLists | None, n: int) -> LogprobsLists | None:
    if lp is None or len(lp.token_ids) <= n:
        return lp
    return LogprobsLists(lp.token_ids[:n], lp.logprobs[:n], lp.sampled_token_ranks[:n])


class UpdateFromOutputMixin:
    def update_from_output(
        self: Scheduler, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        requests = self.requests
        kv = self.kv_cache_manager
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        all_logprobs = model_runner_output.logprobs
        spec = scheduler_output.scheduled_spec_decode_tokens
        outputs: list[EngineCoreOutput] = []
        any_stopped = False
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.is_finished():
                # Finished or aborted while this step was in flight: its final output is
                # out and its blocks wait behind this step's fence. Nothing to settle.
                continue
            request.num_in_flight_tokens -= num_scheduled
            assert request.num_in_flight_tokens >= 0, (
                f"{rid}: in-flight tokens {request.num_in_flight_tokens} after settling "
                f"{num_scheduled} of step {scheduler_output.step_id}")
            if request.num_stale_output_tokens > 0:
                # Scheduled before a preemption reset the ledger: drain, never append.
                request.num_stale_output_tokens -= num_scheduled
                assert request.num_stale_output_tokens >= 0, (
                    f"{rid}: stale tokens {request.num_stale_output_tokens} after draining "
                    f"{num_scheduled} of step {scheduler_output.step_id}")
                continue
            i = index.get(rid)
            generated = sampled[i] if i is not None else []
            drafts = spec.get(rid) if spec else None
            if drafts:
                # Rejected drafts roll back both counters (§3 rule 3). Their KV is garbage
                # past num_computed_tokens: overwritten by later steps, never cached.
                num_accepted = max(len(generated) - 1, 0)
                num_rejected = len(drafts) - num_accepted
                assert num_rejected >= 0, (
                    f"{rid}: {len(generated)} tokens back for {len(drafts)} drafts")
                if num_rejected > 0:
                    request.num_computed_tokens -= num_rejected
                    if self.books_output_placeholders:
                        request.num_output_placeholders -= num_rejected
                proposed = model_runner_output.num_draft_tokens
                self.spec_decode_counters.observe(
                    len(drafts) if proposed is None or i is None else proposed[i], num_accepted)
            new_token_ids, stopped = self._update_request_with_output(request, generated)
            if request.use_structured_output and new_token_ids:
                new_token_ids = new_token_ids[:self._advance_grammar(request, new_token_ids)]
                stopped = stopped or request.is_finished()
            # KV of tokens whose steps have all returned is settled: cache its full blocks.
            kv.cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)
            prompt_lp = take_new_prompt_logprobs(
                request, model_runner_output.prompt_logprobs_dict.get(rid))
            if not new_token_ids and not stopped and prompt_lp is None:
                continue
            lp = all_logprobs[i] if all_logprobs is not None and i is not None else None
            if stopped:
                any_stopped = True
                out = self._final_output(request, new_token_ids)
                self._free_request(request)
            else:
                out = EngineCoreOutput(rid, new_token_ids,
                                       num_cached_tokens=max(request.num_cached_tokens, 0))
            out.new_logprobs = _slice_logprobs(lp, len(new_token_ids))
            out.new_prompt_logprobs = prompt_lp
            outputs.append(out)
        if any_stopped:
            self.running = [r for r in self.running if not r.is_finished()]
        kv.on_step_processed(scheduler_output.step_id)
        return self._engine_core_outputs(outputs)

    def _update_request_with_output(
        self: Scheduler, request: Request, generated: list[int]
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
                    # The trimmed tokens' inputs were computed for nothing; keep
                    # num_computed_tokens = "all known tokens but the last".
                    request.num_computed_tokens -= num_new - n
                    kept = generated[:n]
                break
        if self.books_output_placeholders:
            # Settle every returned token, including those trimmed at a stop (§3 rule 1).
            request.num_output_placeholders -= num_new
            assert request.num_output_placeholders >= 0, (
                f"{request.request_id}: placeholders {request.num_output_placeholders} after "
                f"settling {num_new} returned tokens")
        self.counters.generation_tokens += len(kept)
        if first_output:
            self.counters.prompt_tokens += request.num_prompt_tokens
        if self.enable_caching:
            update_block_hashes(request, self.block_size)
        return kept, stopped
