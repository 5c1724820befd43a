"""What one ``Scheduler.schedule()`` decides, and the SchedulerOutput diff built from it.

A step sends new requests (and requests the workers must rebuild) in full, running ones
as new blocks and counts; under synchronous PP it also sends the sampled ids the earlier
stages never saw (docs/architecture.md §4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from raylm.scheduler.core_outputs import CachedRequestData, NewRequestData, SchedulerOutput
from raylm.scheduler.request import Request


@dataclass
class StepPlan:
    """What one ``schedule()`` has decided so far."""

    budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: list[tuple[Request, list[int]]] = field(default_factory=list)
    resent: list[Request] = field(default_factory=list)  # rebuilt on the workers (KV loads)
    preempted: list[Request] = field(default_factory=list)
    blocked_on_kv: bool = False


def make_scheduler_output(step: int, plan: StepPlan, new_reqs: list[Request],
                          finished_req_ids: set[str],
                          get_block_ids: Callable[[str], list[int]],
                          sampled_ids_lookback: int | None) -> SchedulerOutput:
    """The step's diff. ``sampled_ids_lookback``: None when the ranks know every sampled
    id; with sync PP, how many positions before a step's inputs its ids start (the
    drafts accepted last step were never inputs of the stages that do not sample)."""
    num_scheduled_tokens = plan.num_scheduled_tokens
    cached = plan.cached
    return SchedulerOutput(
        step_id=step,
        scheduled_new_reqs=[new_request_data(r, get_block_ids(r.request_id))
                            for r in new_reqs],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[r.request_id for r, _ in cached],
            new_block_ids=[ids for _, ids in cached],
            num_computed_tokens=[r.num_computed_tokens for r, _ in cached],
            new_token_ids=[unseen_output_ids(r, num_scheduled_tokens[r.request_id],
                                             sampled_ids_lookback) for r, _ in cached],
        ),
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
        finished_req_ids=finished_req_ids,
        # The workers drop the state of both before the step: a preempted request is
        # gone, a rebuilt one comes back in scheduled_new_reqs.
        preempted_req_ids={r.request_id for r in plan.preempted + plan.resent},
        scheduled_spec_decode_tokens=plan.spec_tokens,
    )


def unseen_output_ids(request: Request, num_new: int, lookback: int | None) -> list[int]:
    """Output ids among this step's inputs, for ranks that did not sample them."""
    if lookback is None:
        return []
    # From k tokens earlier: the last step's accepted drafts were never inputs there.
    start = max(request.num_computed_tokens - lookback, request.num_prompt_tokens)
    return request.all_token_ids[start:request.num_computed_tokens + num_new]


def new_request_data(request: Request, block_ids: list[int]) -> NewRequestData:
    return NewRequestData(
        req_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),  # workers may extend theirs
        output_token_ids=list(request.output_token_ids),
        sampling_params=request.sampling_params,
        block_ids=block_ids,
        num_computed_tokens=request.num_computed_tokens,
        sampling_seed=request.sampling_seed,
        lora_request=request.lora_request,
        state_snapshot=request.state_snapshot,
    )
