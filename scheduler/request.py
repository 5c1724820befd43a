"""One mutable Request per generation, with the async-scheduling ledger (docs/architecture.md §3).

Counters keep vLLM's names. Under async scheduling the scheduler books output tokens it
has not seen yet (``num_output_placeholders``) and settles them when the step returns;
``num_in_flight_tokens`` counts tokens scheduled in steps whose results are not back, and
``num_stale_output_tokens`` the part of those that belongs to a state rolled back by
preemption. Only the named methods below mutate the token lists.
"""

from __future__ import annotations

import time
from enum import IntEnum

from raylm.scheduler.core_outputs import FinishReason
from raylm.scheduler.lora import LoRARequest
from raylm.scheduler.sampling_params import SamplingParams
from raylm.scheduler.structured.manager import StructuredOutputRequest


class InvalidRequestError(ValueError):
    """A request that can never be served as given: the client's to fix (HTTP 400).
    ``param`` names the request field at fault, as OpenAI's error JSON does. Every other
    exception out of the engine is the engine's fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # crosses Ray (pickle) with its param
        return type(self), (str(self), self.param)


def check_prompt_room(num_prompt_tokens: int, max_model_len: int) -> None:
    """A Request needs at least one prompt token and room for one output token. The
    intake's ``validate_prompt`` (raylm.scheduler.intake) reports this to the client; here it
    is the ledger's invariant, kept for whoever builds a Request directly."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError("prompt is empty (0 tokens); at least one token is required.",
                                  "prompt")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"prompt of {num_prompt_tokens} tokens leaves no room to generate within "
            f"max_model_len={max_model_len} (the model's maximum context length).", "prompt")


class RequestStatus(IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 0
    WAITING_FOR_FSM = 1  # its grammar is still compiling (structured outputs)
    # Its KV is being loaded from outside the engine (a KV connector); it holds its blocks
    # but no place in the running batch.
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8  # e.g. a token its grammar rejects

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        sampling_seed: int,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        check_prompt_room(len(prompt_token_ids), max_model_len)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.max_model_len = max_model_len
        self.sampling_seed = sampling_seed
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # The LoRA adapter the request runs with (None: the base model). It keys the
        # request's prefix-cache blocks (kv_cache_utils) and counts toward max_loras.
        self.lora_request = lora_request
        self.num_lora_skips = 0  # steps passed over for want of a LoRA slot (scheduler/lora.py)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = room if sampling_params.max_tokens is None else min(
            sampling_params.max_tokens, room)

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)

        # The ledger (docs/architecture.md §3).
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.spec_token_ids: list[int] = []
        self.is_prefill_chunk = False
        self.next_decode_eligible_step = 0

        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        # Prompt positions whose logprobs went out (prompt_logprobs): a prefix-cache hit may
        # cover only these, and a recomputation after preemption does not resend them.
        self.num_prompt_logprobs_done = 0
        self.num_preemptions = 0
        # Chained hashes of the full blocks of known tokens (prefix caching).
        self.block_hashes: list[int] = []
        # Hybrid models: the state snapshot its prefix hit starts from (set at admission,
        # sent with its NewRequestData; scheduler/kv/state_snapshots.py), -1: none.
        self.state_snapshot = -1
        # The grammar is told max_tokens so JSON mode can close in time; not under
        # min_tokens, whose masked stop token the closing might need before it is allowed.
        self.structured_output_request = (
            None if sampling_params.structured_outputs is None
            else StructuredOutputRequest(
                sampling_params.structured_outputs,
                self.max_tokens if sampling_params.min_tokens == 0 else None))
        # Disaggregated prefill/decode (vLLM's ``extra_args["kv_transfer_params"]``): what
        # a KV connector needs to send or pull this request's KV.
        # Its own copy: a connector marks what it has done in it.
        params = (sampling_params.extra_args or {}).get("kv_transfer_params")
        self.kv_transfer_params: dict | None = dict(params) if params else None

    # Token views. Read-only by convention: mutate through append_output_token_ids only.
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus confirmed output tokens."""
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISHED_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}/{self.max_tokens}, "
            f"computed={self.num_computed_tokens}, placeholders={self.num_output_placeholders}, "
            f"in_flight={self.num_in_flight_tokens}, stale={self.num_stale_output_tokens})"
        )
