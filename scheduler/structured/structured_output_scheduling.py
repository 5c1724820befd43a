"""The scheduler's side of structured outputs (docs/architecture.md §3, rule 7).

``StructuredOutputScheduling`` is owned by the Scheduler; it reads the Scheduler's
requests through a read-only view and hands back the requests whose grammar is ready (the
Scheduler queues them). It parks constrained requests while their grammar compiles (``waiting_for_fsm``), marks
the steps whose sampling needs a bitmask, builds that bitmask, and advances grammars on
settled tokens only. A token a grammar rejects ends that request with finish_reason
"error", never the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import wait

from raylm.scheduler.async_ledger import has_unsettled_earlier_tokens
from raylm.scheduler.core_outputs import EngineCoreOutput, SchedulerOutput
from raylm.scheduler.request import Request, RequestStatus
from raylm.scheduler.structured.manager import GrammarOutput, StructuredOutputManager

logger = logging.getLogger(__name__)


class StructuredOutputScheduling:
    def __init__(self, *, requests: Mapping[str, Request],
                 manager: StructuredOutputManager | None, num_spec_tokens: int,
                 books_output_placeholders: bool,
                 finish_request: Callable[[Request, list[int]], EngineCoreOutput]) -> None:
        self.requests = requests  # read-only
        self.manager = manager  # None: this engine has no structured-output backend
        self.num_spec_tokens = num_spec_tokens
        self.books_output_placeholders = books_output_placeholders
        self.finish_request = finish_request  # frees it, returns its final output
        # Constrained requests whose grammar still compiles (WAITING_FOR_FSM), in arrival order.
        self.waiting_for_fsm: list[Request] = []

    # ---- admission -----------------------------------------------------------------
    def validate_request(self, request: Request) -> None:
        if request.use_structured_output and self.manager is None:
            raise ValueError(f"request {request.request_id!r} asks for structured outputs "
                             "but this engine has no structured-output backend.")

    def add_request(self, request: Request) -> bool:
        """Park a constrained request until its grammar is compiled. True if parked."""
        so_request = request.structured_output_request
        if so_request is None:
            return False
        assert self.manager is not None
        request.status = RequestStatus.WAITING_FOR_FSM
        self.manager.grammar_init(so_request)
        self.waiting_for_fsm.append(request)
        return True

    def take_compiled(self) -> tuple[list[Request], list[EngineCoreOutput]]:
        """The requests whose grammar is ready (arrival order), for the waiting queue, and
        the final outputs of those whose grammar failed to compile (finished here)."""
        if not self.waiting_for_fsm:
            return [], []
        still: list[Request] = []
        ready: list[Request] = []
        outputs = []
        for request in self.waiting_for_fsm:
            so_request = request.structured_output_request
            assert so_request is not None
            if not so_request.is_ready():
                still.append(request)
            elif so_request.error is not None:
                logger.error("request %s: its grammar did not compile: %s",
                             request.request_id, so_request.error)
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(self.finish_request(request, []))
            else:
                request.status = RequestStatus.WAITING
                ready.append(request)
        self.waiting_for_fsm = still
        return ready, outputs

    def wait_for_grammars(self, timeout: float) -> None:
        """Block up to ``timeout`` for the oldest compiling grammar (nothing else to run)."""
        so_request = self.waiting_for_fsm[0].structured_output_request
        if so_request is not None and so_request.future is not None:
            wait([so_request.future], timeout=timeout)

    # ---- a step's sampling ---------------------------------------------------------
    def mark_structured_output(self, scheduler_output: SchedulerOutput) -> None:
        """List the constrained requests that sample in the step and whether one of them
        waits for earlier tokens. Called right after ``schedule()`` (its booking done)."""
        ids: list[str] = []
        pending = False
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests[rid]
            if not request.use_structured_output or request.is_prefill_chunk:
                continue
            ids.append(rid)
            booked = (1 + len(spec.get(rid, ()))) if self.books_output_placeholders else 0
            pending = pending or has_unsettled_earlier_tokens(request, booked)
        scheduler_output.structured_output_request_ids = ids
        scheduler_output.pending_structured_output_tokens = pending

    def structured_output_ready(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether every grammar of a deferred step has seen all tokens before it (only
        the step's own booking is still unsettled)."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.structured_output_request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if has_unsettled_earlier_tokens(request, 1 + len(spec.get(rid, ()))):
                return False
        return True

    def needs_draft_token_ids(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether the step's bitmask needs the drafts its forward placed (a constrained
        request of it verifies drafts)."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        return bool(spec) and any(
            rid in spec for rid in scheduler_output.structured_output_request_ids)

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput,
                            draft_token_ids: dict[str, list[int]] | None = None,
                            ) -> GrammarOutput:
        """One bitmask row per constrained request of the step, in the step's order; a
        request finished meanwhile gets an all-allowed row (its token is discarded).

        With speculative decoding, ``draft_token_ids`` are the drafts the step placed:
        each request gets a row per verified position, its drafts cut at the first one
        its grammar refuses (a request finished meanwhile keeps none)."""
        assert self.manager is not None
        ids = scheduler_output.structured_output_request_ids
        grammars = []
        for rid in ids:
            request = self.requests.get(rid)
            so_request = None if request is None or request.is_finished() else (
                request.structured_output_request)
            grammars.append(None if so_request is None else so_request.grammar)
        drafts = None
        if self.num_spec_tokens:
            placed = draft_token_ids or {}
            drafts = [list(placed.get(rid, ())) if g is not None else []
                      for rid, g in zip(ids, grammars, strict=True)]
        return self.manager.build_bitmask(list(ids), grammars, drafts)

    # ---- settled tokens ------------------------------------------------------------
    def advance_grammar(self, request: Request, new_token_ids: list[int]) -> int:
        """Feed settled tokens (a step's accepted run) to the request's grammar, one by
        one. Returns how many of them to keep: all, unless

        - the grammar rejects one (a bug or a tokenizer mismatch): the request finishes
          with ERROR, keeping the tokens through the rejected one;
        - the grammar terminates (it accepted a stop token that does not stop the request,
          e.g. under ignore_eos): its text is complete, so the request stops there.

        A request it finishes is freed by the caller."""
        so_request = request.structured_output_request
        if so_request is None or so_request.grammar is None:
            return len(new_token_ids)
        grammar = so_request.grammar
        for n, token in enumerate(new_token_ids, 1):
            if not grammar.accept_tokens([token]):
                logger.error("request %s: its grammar rejected token %d of %s; finishing "
                             "it with finish_reason error", request.request_id, token,
                             new_token_ids)
                request.status = RequestStatus.FINISHED_ERROR
                return n
            if grammar.is_terminated():
                if not request.is_finished():
                    request.status = RequestStatus.FINISHED_STOPPED
                return n
        return len(new_token_ids)
