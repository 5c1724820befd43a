"""Prompt logprobs on the scheduler side: each step's chunk is passed on exactly once.

The runner returns the logprobs of the prompt positions it computed in a step. A request
preempted and recomputed computes some of them again; those rows were sent already and
are dropped here, so the client sees every prompt position once and in order.
"""

from __future__ import annotations

from raylm.scheduler.core_outputs import LogprobsLists, PromptLogprobsChunk
from raylm.scheduler.request import Request


def take_new_prompt_logprobs(request: Request, chunk: PromptLogprobsChunk | None
                             ) -> LogprobsLists | None:
    """The rows of ``chunk`` not yet sent for ``request`` (None when there are none)."""
    if chunk is None:
        return None
    done = request.num_prompt_logprobs_done
    assert chunk.start <= done, (
        f"{request.request_id}: prompt logprobs from position {chunk.start} but only "
        f"{done} were sent (a position was skipped)")
    skip = done - chunk.start
    if skip >= chunk.num_rows:
        return None
    request.num_prompt_logprobs_done = chunk.start + chunk.num_rows
    lp = chunk.lists
    return LogprobsLists(lp.token_ids[skip:], lp.logprobs[skip:], lp.sampled_token_ranks[skip:])
