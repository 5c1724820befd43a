"""AsyncScheduler: books each decode's output tokens before the step has run.

It plans step t+1 while step t is in flight, so it cannot wait for t's token to know a
request's length: each request that samples books ``1 + len(drafts)`` output placeholders
(docs/architecture.md §3 rule 1), settled when the step returns, and waits out the PP
decode cadence (§4). Everything else is the base class's, so both modes share one path.
"""

from __future__ import annotations

from raylm.scheduler.async_ledger import book_output_placeholders
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import SchedulerOutput
from raylm.scheduler.scheduler import Scheduler
from raylm.scheduler.structured.manager import StructuredOutputManager


class AsyncScheduler(Scheduler):
    books_output_placeholders = True

    def __init__(self, config: EngineConfig, num_kv_blocks: int,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        super().__init__(config, num_kv_blocks, structured_output_manager)
        # A PP stage sees a request's token again only pp steps later (docs/architecture.md
        # §4); with pp=1 a request is eligible again at the very next step.
        self.decode_stagger = config.parallel_config.pipeline_parallel_size

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # Base first: it decides is_prefill_chunk, which must not see this step's
        # placeholders (the last prefill chunk would look like a decode otherwise).
        super()._update_after_schedule(scheduler_output)
        spec = scheduler_output.scheduled_spec_decode_tokens
        requests = self.requests
        next_eligible = self.current_step + self.decode_stagger
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests[rid]
            if request.is_prefill_chunk:
                continue  # a non-final chunk samples nothing
            book_output_placeholders(request, len(spec.get(rid, ())),
                                     self.num_sampled_tokens_per_step)
            request.next_decode_eligible_step = next_eligible
