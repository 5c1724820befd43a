"""Turn EngineCoreOutputs into user-facing RequestOutputs: detokenize, stop strings, logprobs.

One ``RequestState`` per engine request; ``n > 1`` requests fan out into child engine
requests ``"{i}_{parent_id}"`` gathered into one RequestOutput. Stop strings are found here,
after detokenization; the request is then reported for abort so the engine frees its KV
blocks, and its tokens still in flight are dropped. ``SamplingParams.output_kind`` says what
an output carries: everything so far, only what is new, or nothing until the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from raylm.cluster.engine.detokenizer import IncrementalDetokenizer
from raylm.cluster.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from raylm.scheduler.core_outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
)
from raylm.scheduler.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list[RequestState] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # filled from the first child's outputs
    num_sent_prompt_logprobs: int = 0  # DELTA: entries already delivered
    pooled: list[float] | None = None  # an embedding request's vector

    @property
    def finished(self) -> bool:
        for c in self.children:  # a loop, not all(genexpr): read for every request each step
            if c.finish_reason is None:
                return False
        return True

    def make_output(self, finished: bool | None = None) -> RequestOutput:
        if finished is None:
            finished = self.finished
        delta = self.params.output_kind == RequestOutputKind.DELTA
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None:
            start = self.num_sent_prompt_logprobs if delta else 0
            prompt_logprobs = prompt_logprobs[start:]
            self.num_sent_prompt_logprobs = len(self.prompt_logprobs)  # type: ignore[arg-type]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.make_completion(delta) for c in self.children], finished=finished,
            num_cached_tokens=self.num_cached_tokens, metrics=self.metrics, error=self.error,
            prompt_logprobs=prompt_logprobs, pooled=self.pooled,
        )


@dataclass
class RequestState:
    index: int
    engine_request_id: str
    parent: ParentRequest
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA: how much of the token ids / text has been delivered (logprobs follow tokens).
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    def make_completion(self, delta: bool = False) -> CompletionOutput:
        """Everything so far; with ``delta``, only what the previous call did not return."""
        finished = self.finish_reason is not None
        text = self.detokenizer.get_text(finished)
        token_ids = self.detokenizer.token_ids
        start = self.num_sent_tokens if delta else 0
        if delta:
            # The held-back tail of a stop string is never sent, so the text only grows.
            text = text[self.num_sent_chars:]
            self.num_sent_chars += len(text)
            self.num_sent_tokens = len(token_ids)
        return CompletionOutput(
            index=self.index, text=text, token_ids=token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[start:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.states: dict[str, RequestState] = {}  # by engine request id

    def add_request(self, parent: ParentRequest, child_ids: list[str]) -> None:
        if parent.request_id in self.parents:
            raise ValueError(f"request_id {parent.request_id!r} is already in use.")
        self.parents[parent.request_id] = parent
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]  # the first prompt token has no logprob
        for i, child_id in enumerate(child_ids):
            state = RequestState(
                index=i, engine_request_id=child_id, parent=parent,
                detokenizer=IncrementalDetokenizer(self.tokenizer, parent.params, parent.prompt_token_ids),
                logprobs=[] if parent.params.logprobs is not None else None,
                cumulative_logprob=0.0 if parent.params.logprobs is not None else None,
            )
            parent.children.append(state)
            self.states[child_id] = state

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.engine_request_id for c in parent.children] if parent else []

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process_outputs(
        self, engine_core_outputs: EngineCoreOutputs
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs of parents that changed, engine request ids to abort)."""
        now = time.monotonic()
        changed: dict[str, ParentRequest] = {}
        to_abort: list[str] = []
        for out in engine_core_outputs.outputs:
            state = self.states.get(out.request_id)
            if state is None or state.finish_reason is not None:
                continue  # finished here already (stop string); late tokens are dropped
            parent = state.parent
            if out.num_cached_tokens:
                parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.new_token_ids:
                parent.metrics.first_token_time = parent.metrics.first_token_time or now
                parent.metrics.last_token_time = now
            if out.new_prompt_logprobs is not None and state.index == 0:
                self._append_prompt_logprobs(parent, out.new_prompt_logprobs, state.detokenizer)
            if out.pooled is not None:
                parent.pooled = out.pooled
            if self._apply(state, out):
                to_abort.append(out.request_id)
            changed[parent.request_id] = parent
        results = []
        for parent in changed.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                self._remove(parent)
            elif parent.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            results.append(parent.make_output(finished))
        return results, to_abort

    def _apply(self, state: RequestState, out: EngineCoreOutput) -> bool:
        """Apply new tokens; True when a stop string finished the request here."""
        detok = state.detokenizer
        for i, token_id in enumerate(out.new_token_ids):
            if out.new_logprobs is not None and state.logprobs is not None:
                self._append_logprobs(state, out.new_logprobs, i, detok)
            stop_str = detok.update(token_id)
            if stop_str is not None:
                state.finish_reason, state.stop_reason = "stop", stop_str
                return not out.finished
        if out.finish_reason is not None:
            detok.flush()
            state.finish_reason = out.finish_reason.value
            state.stop_reason = out.stop_reason
            if out.finish_reason == FinishReason.ABORT:
                # A client's abort removes its request before the engine answers
                # (abort_request), so an ABORT that reaches here is the engine's own: it
                # died under the request (a worker or a step failed) or refused it. The
                # caller must hear an error, not a finished, truncated output.
                state.parent.error = ("the engine aborted the request before it finished "
                                      "(the engine died or refused it)")
        return False

    @staticmethod
    def _append_prompt_logprobs(parent: ParentRequest, lp: LogprobsLists,
                                detok: IncrementalDetokenizer) -> None:
        # Every child computes them; the first child's are kept (they are the same).
        assert parent.prompt_logprobs is not None
        for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.sampled_token_ranks,
                                  strict=True):
            entry = {ids[0]: Logprob(lps[0], rank, detok.decode_token(ids[0]))}
            for r, (tid, value) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
                entry.setdefault(tid, Logprob(value, r, detok.decode_token(tid)))
            parent.prompt_logprobs.append(entry)

    def _append_logprobs(
        self, state: RequestState, lp: LogprobsLists, i: int, detok: IncrementalDetokenizer
    ) -> None:
        # Row i: index 0 is the sampled token, then the top-k.
        ids, lps, rank = lp.token_ids[i], lp.logprobs[i], lp.sampled_token_ranks[i]
        entry = {ids[0]: Logprob(lps[0], rank, detok.decode_token(ids[0]))}
        for r, (tid, value) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            entry.setdefault(tid, Logprob(value, r, detok.decode_token(tid)))
        state.logprobs.append(entry)  # type: ignore[union-attr]
        state.cumulative_logprob = (state.cumulative_logprob or 0.0) + lps[0]

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Finish a parent as aborted (client gone, engine dead); returns its final output."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        parent.error = error
        for c in parent.children:
            if c.finish_reason is None:
                c.finish_reason = "abort"
        self._remove(parent)
        return parent.make_output()

    def _remove(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for c in parent.children:
            self.states.pop(c.engine_request_id, None)
