"""The plain data that crosses layer boundaries.

SchedulerOutput (scheduler -> workers) is a diff: a request's prompt, params and block
table are sent once (``NewRequestData``); afterwards only what changed
(``CachedRequestData``). Workers keep per-request state and apply each diff in order.
ModelRunnerOutput (worker -> EngineCore) carries sampled ids and logprobs.
EngineCoreOutput (EngineCore -> engine client) carries new tokens per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from raylm.scheduler.lora import LoRARequest
from raylm.scheduler.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen (or must rebuild after preemption).

    ``prompt_token_ids`` is the prompt; ``output_token_ids`` the outputs already confirmed
    (non-empty only when a preempted request resumes). ``num_computed_tokens`` tokens are
    already in the KV cache (prefix-cache hits); this step computes the next
    ``SchedulerOutput.num_scheduled_tokens[req_id]`` tokens from there.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sampling_seed: int  # explicit seed, or one drawn for the request at arrival
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    # Hybrid models: the snapshot slot its recurrent state starts from (a prefix hit;
    # scheduler/kv/state_snapshots.py), -1: zeros
    state_snapshot: int = -1


@dataclass
class CachedRequestData:
    """Requests the workers already hold. Parallel lists, one entry per request.

    ``num_computed_tokens[i]`` is the request's computed count before this step (it
    includes output placeholders under async scheduling). ``new_block_ids[i]`` are block
    ids appended to its block table. ``new_token_ids[i]`` is only filled where a rank
    cannot know the tokens itself (empty otherwise).
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    step_id: int  # strictly increasing; fences deferred frees, drives the PP ring
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose worker state must be dropped before this step runs.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Drafts per request (speculative decoding; placeholders are -1 under async).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Grammar-constrained requests that sample in this step: the workers defer their
    # sampling to ``sample_tokens(GrammarOutput)`` (empty: sample at once, as always).
    structured_output_request_ids: list[str] = field(default_factory=list)
    # One of them has unsettled placeholders: its bitmask needs the previous step's token,
    # so the EngineCore sends ``sample_tokens`` only once that step's result is applied.
    pending_structured_output_tokens: bool = False
    # The KV connector's per-step orders to the workers (loads, saves, sends; None: none).
    kv_connector_metadata: Any = None
    # Hybrid models with prefix caching: per request, the states this step saves, each
    # (token count it follows: a block boundary, snapshot slot).
    state_snapshot_saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # Diffusion models: requests whose canvas starts at this step, each with the number of
    # denoising steps its previous canvas took (0: its first); the runner starts a new
    # canvas for them and continues every other one (docs/architecture.md §23).
    new_canvases: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Logprobs of one request's tokens in one step; row i is its i-th sampled token.

    ``token_ids[i]`` / ``logprobs[i]`` list the sampled token first, then the top-k
    (k = SamplingParams.logprobs); ``sampled_token_ranks[i]`` is the sampled token's rank
    (1 = most likely) in the raw distribution.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs computed in one step: row j is the prompt token at position
    ``start + 1 + j`` (predicted from position ``start + j``), with ``lists``' layout: the
    actual token first, then the top-k (k = SamplingParams.prompt_logprobs)."""

    start: int
    lists: LogprobsLists

    @property
    def num_rows(self) -> int:
        return len(self.lists.token_ids)


@dataclass
class KVConnectorOutput:
    """What the workers' KV connector reports with a step (vLLM's names): requests whose
    blocks finished sending (the producer may free them) or receiving (the consumer may
    schedule them), blocks whose load failed (their KV is garbage: recompute), and
    counters since the previous report (bytes, seconds, blocks; ``kv_transfer_stats``)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.stats)


def merge_kv_connector_outputs(a: KVConnectorOutput | None, b: KVConnectorOutput | None
                               ) -> KVConnectorOutput | None:
    """Two reports as one (a step's report kept for the next output)."""
    if a is None or b is None:
        return a if b is None else b
    stats = dict(a.stats)
    for key, value in b.stats.items():
        stats[key] = stats.get(key, 0.0) + value
    return KVConnectorOutput(a.finished_sending | b.finished_sending,
                             a.finished_recving | b.finished_recving,
                             a.invalid_block_ids | b.invalid_block_ids, stats)


@dataclass
class ModelRunnerOutput:
    """One step's result. ``sampled_token_ids[i]`` is empty for a non-final prefill chunk.

    ``logprobs[i]`` is request i's LogprobsLists (one row per sampled token) when it
    asked for logprobs, else None; ``logprobs`` itself is None when no request did.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: list[LogprobsLists | None] | None = None
    # Speculative decoding: drafts the worker actually proposed per request (it may find
    # fewer than the scheduler booked); None = as booked.
    num_draft_tokens: list[int] | None = None
    # Requests that asked for prompt logprobs and had prompt tokens in this step.
    prompt_logprobs_dict: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Embedding requests whose prompt this step completed: their pooled vectors.
    pooled_dict: dict[str, list[float]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass
class DraftTokenIds:
    """The drafts a step placed for its grammar-constrained requests (speculative
    decoding): the result of such a step's ``execute_model``, which the grammar checks
    before its ``sample_tokens`` verifies them."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None  # rows match new_token_ids
    # The next prompt tokens' logprobs (rows continue where the previous output's ended).
    new_prompt_logprobs: LogprobsLists | None = None
    pooled: list[float] | None = None  # an embedding request's vector (pooling)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that finished the request
    num_cached_tokens: int = 0
    # A finished request whose KV a peer engine will pull (prefill side of disaggregation).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # since the previous stats
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None


@dataclass(frozen=True)
class DummyBatch:
    """A step message for a DP rank without a forward of its own in a wave step: every
    worker of its executor joins its stage's expert-parallel collectives with no rows."""
