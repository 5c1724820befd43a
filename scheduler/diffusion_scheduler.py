"""The schedulers of a diffusion language model (docs/architecture.md §23): a step samples
no token (``num_sampled_tokens_per_step`` is 0); a running request's step is its committed
tokens not yet encoded, then a canvas of ``canvas_length`` (L) placeholders after them, which
the runner denoises and, on the step that ends the canvas, returns committed.

The ledger, per request:

- ``num_computed_tokens`` counts committed tokens whose KV the encoder writes (booked when
  scheduled, as a prefill's); canvas positions never count, so a canvas is scheduled at the
  same L positions step after step, its slots allocated past the computed ones.
- A canvas's denoising steps are its drafts: ``scheduled_spec_decode_tokens`` holds L
  ``-1`` placeholders for each. Async scheduling books L output placeholders per step (the
  canvas, no bonus token), settled when the step returns: the committed tokens, and the
  rest of the L as rejected.
- ``CanvasLedger`` counts the current canvas's steps returned and in flight. Async, a
  canvas gets another step while its steps so far could still all be short of
  ``max_denoising_steps``; the runner turns a step that follows the one that ended the
  canvas (adaptive stopping) into a no-op that returns nothing. A new canvas starts once
  the commit is seen, its first step in ``SchedulerOutput.new_canvases``.
- Prefix caching indexes only encoded blocks: canvas KV sits in slots that the encoder
  rewrites once the canvas is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylm.scheduler.async_ledger import book_output_placeholders, book_scheduled_tokens
from raylm.scheduler.async_scheduler import AsyncScheduler
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import EngineCoreOutput, SchedulerOutput
from raylm.scheduler.request import InvalidRequestError, Request
from raylm.scheduler.scheduler import Scheduler
from raylm.scheduler.scheduler_update import StepSettler
from raylm.scheduler.structured.manager import StructuredOutputManager

# SamplingParams fields a diffusion request cannot honour (its sampler is the model's
# denoising loop), each with the value that means "unset".
_UNSUPPORTED_SAMPLING = (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                         ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                         ("repetition_penalty", 1.0), ("min_tokens", 0), ("logprobs", None),
                         ("prompt_logprobs", None), ("structured_outputs", None),
                         ("logit_bias", None), ("pooling", None))


@dataclass
class CanvasLedger:
    """One request's denoising, as the scheduler books it."""

    start_step: int = 0  # the step that scheduled the current canvas's first (0: none)
    steps_done: int = 0  # its steps returned
    steps_in_flight: int = 0  # its steps scheduled, not yet returned
    denoise_in_flight: int = 0  # denoising steps in flight, of any canvas
    last_canvas_steps: int = 0  # the steps the previous canvas took

    @property
    def active(self) -> bool:
        return self.start_step > 0


class DiffusionStepSettler(StepSettler):
    outputs_are_computed = False  # a committed canvas is encoded by the next step

    def __init__(self, *, canvases: dict[str, CanvasLedger], canvas_length: int,
                 **collaborators: Any) -> None:
        super().__init__(**collaborators)
        self.canvases = canvases
        self.canvas_length = canvas_length
        self.num_discarded_steps = 0  # steps after the end of their canvas (async)

    def _settle_drafts(self, request: Request, generated: list[int], drafts: list[int],
                       step_id: int, num_proposed: int) -> None:
        """A denoising step returned: the committed canvas, or nothing."""
        L = self.canvas_length
        ledger = self.canvases[request.request_id]
        ledger.denoise_in_flight -= 1
        if self.books_output_placeholders:
            # The L booked: the returned ones settle as outputs, the rest go here.
            request.num_output_placeholders -= L - len(generated)
        if not ledger.active or step_id < ledger.start_step:
            # A step of a canvas already committed: the runner ran it as a no-op.
            assert not generated, f"{request.request_id}: a finished canvas returned tokens"
            self.num_discarded_steps += 1
            return
        ledger.steps_in_flight -= 1
        ledger.steps_done += 1
        if generated:
            assert len(generated) == L, f"{request.request_id}: a canvas of {len(generated)}"
            ledger.last_canvas_steps = ledger.steps_done
            # Its steps still in flight are no-ops; the next canvas starts after encoding.
            ledger.start_step = ledger.steps_done = ledger.steps_in_flight = 0

    def _num_settled_tokens(self, request: Request) -> int:
        # Canvas tokens in flight are no encoded KV: only encoding steps count.
        ledger = self.canvases[request.request_id]
        in_flight_encoded = (request.num_in_flight_tokens
                             - self.canvas_length * ledger.denoise_in_flight)
        return request.num_computed_tokens - in_flight_encoded


class DiffusionScheduler(Scheduler):
    def __init__(self, config: EngineConfig, num_kv_blocks: int,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        diffusion = config.model_config.diffusion_config
        self.canvas_length = diffusion.canvas_length
        self.max_denoising_steps = diffusion.max_denoising_steps
        self.canvases: dict[str, CanvasLedger] = {}
        self.num_denoising_rows = 0  # canvases run, one per request per step (no-ops too)
        super().__init__(config, num_kv_blocks, structured_output_manager)
        # A shared, read-only canvas of placeholders (the runner keeps the real one).
        self._canvas_placeholders = [-1] * self.canvas_length

    def _make_step_settler(self, **collaborators: Any) -> StepSettler:
        return DiffusionStepSettler(canvases=self.canvases, canvas_length=self.canvas_length,
                                    **collaborators)

    # ---- requests ------------------------------------------------------------------
    def validate_request(self, request: Request) -> None:
        """Besides the base checks: every canvas the request may need fits max_model_len
        (its last one starts before max_tokens ends), and no sampling field that the
        denoising loop cannot honour is set."""
        params = request.sampling_params
        for name, unset in _UNSUPPORTED_SAMPLING:
            value = getattr(params, name)
            if value != unset:
                raise InvalidRequestError(
                    f"request {request.request_id!r}: {name}={value!r} is not supported by "
                    f"the diffusion model {self.config.model_config.architecture} (its "
                    "tokens come from its denoising loop).", name)
        super().validate_request(request)
        L = self.canvas_length
        canvases = -(-request.max_tokens // L)
        total = request.num_prompt_tokens + canvases * L
        if total > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt {request.num_prompt_tokens} + "
                f"{canvases} canvases of {L} tokens (max_tokens {request.max_tokens}) "
                f"exceeds max_model_len={self.max_model_len}.")
        needed = self.config.kv_blocks_per_request(total)
        if needed > self.kv_cache_manager.num_blocks:
            raise InvalidRequestError(
                f"request {request.request_id!r} needs {needed} KV blocks (prompt and "
                f"{canvases} canvases of {L}) but the pool holds only "
                f"{self.kv_cache_manager.num_blocks}.")

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.canvases[request.request_id] = CanvasLedger()

    def _finish_request(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        self.canvases.pop(request.request_id, None)
        return super()._finish_request(request, new_token_ids)

    def _preempt_request(self, request: Request) -> None:
        # Its canvas starts over; the steps in flight come back stale and are drained.
        super()._preempt_request(request)
        self.canvases[request.request_id] = CanvasLedger()

    # ---- scheduling ----------------------------------------------------------------
    def _num_new_running_tokens(self, request: Request, step: int, budget: int) -> int:
        """Its committed tokens not yet encoded (chunked by the budget) and, once they all
        fit, a canvas: a new one, or the current one's next step while its steps so far
        may all fall short of max_denoising_steps (0: skip it)."""
        L = self.canvas_length
        ledger = self.canvases[request.request_id]
        unencoded = request.num_tokens - request.num_computed_tokens
        if ledger.active:
            assert unencoded == 0, f"{request.request_id}: a canvas over unencoded tokens"
            if ledger.steps_done + ledger.steps_in_flight >= self.max_denoising_steps:
                return 0  # a step in flight ends it
            return L if budget >= L else 0
        if unencoded > 0 and budget < unencoded + L:
            return min(unencoded, budget)  # encoding alone, chunked
        return unencoded + L if budget >= unencoded + L else 0

    def _with_first_drafts(self, request: Request, computed: int, num_new: int,
                           budget: int) -> int:
        # The step that ends the prompt starts its first canvas too, where the budget holds it.
        ends_prompt = computed + num_new == request.num_tokens
        return num_new + self.canvas_length if ends_prompt and budget >= num_new + \
            self.canvas_length else num_new

    def _scheduled_drafts(self, request: Request, num_new: int) -> list[int]:
        unencoded = request.num_tokens - request.num_computed_tokens
        return self._canvas_placeholders if num_new > unencoded else []

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Book encoded tokens as computed and each canvas step on its ledger; async, the
        L output placeholders a denoising step may return (no bonus token)."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        step = scheduler_output.step_id
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[rid]
            canvas = len(spec.get(rid, ()))
            book_scheduled_tokens(request, n - canvas, [])
            request.num_in_flight_tokens += canvas
            if not canvas:
                continue
            ledger = self.canvases[rid]
            if not ledger.active:
                scheduler_output.new_canvases[rid] = ledger.last_canvas_steps
                ledger.start_step = step
            ledger.steps_in_flight += 1
            ledger.denoise_in_flight += 1
            self.num_denoising_rows += 1
            if self.books_output_placeholders:
                book_output_placeholders(request, canvas, self.num_sampled_tokens_per_step)


class DiffusionAsyncScheduler(DiffusionScheduler, AsyncScheduler):
    """Plans step t+1 while step t runs: a canvas's next denoising step is booked before
    the previous one has returned (no PP: its cadence does not apply)."""
