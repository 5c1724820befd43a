"""One rank's runner for a diffusion language model (docs/architecture.md §23): applies
the SchedulerOutput diff, encodes each request's newly committed tokens, runs one
denoising step over every scheduled canvas in one decoder call, and returns each canvas
the step ended, committed.

A step's tokens for a request are its committed tokens to encode (the prompt; then each
committed canvas, read from the device, where the runner kept its argmax), then, when
``scheduled_spec_decode_tokens`` holds its L placeholders, its canvas at the positions
after them. A canvas starts where ``SchedulerOutput.new_canvases`` says; any other
scheduled canvas continues. A canvas that has ended (adaptive stopping, or its last step)
stays as it was: under async scheduling the scheduler may already have booked a step
after the one that ended it, which then runs as a no-op, its state unchanged on the device
and nothing returned. A request with a seed draws from its own generator, seeded with
its ``sampling_seed``, in transformers' order (runner/diffusion_sampler.py); draws a no-op
step made are undone when the next canvas starts (its generator goes back to the state
after the step that ended the previous canvas). A request without a seed draws from the
global generator, batched with the others. Nothing is read back to the host before the
step's output copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from raylm.parallel.context import ParallelContext
from raylm.runner.async_output import AsyncModelRunnerOutput, AsyncOutputCopier
from raylm.runner.attention.bidirectional import build_bidirectional_metadata
from raylm.runner.attention.paged_attention import AttentionMetadata, allocate_kv_cache
from raylm.runner.diffusion_sampler import CanvasState, DiffusionSampler
from raylm.runner.loading.diffusion_loader import get_diffusion_model
from raylm.runner.loading.model_loader import resolve_dtype
from raylm.runner.memory_budget import FIXED_RESERVE_BYTES
from raylm.runner.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import ModelRunnerOutput, SchedulerOutput


@dataclass
class DiffusionRequestState:
    req_id: str
    token_ids: list[int]  # tokens known on the host: the prompt, outputs when (re)sent
    block_ids: list[int]
    generator: torch.Generator | None  # a request with a seed (else the global one)
    canvas: CanvasState | None = None
    canvas_start: int = 0  # the canvas's first position
    ended: torch.Tensor | None = None  # [] bool on the device: the canvas has ended
    # Async: the generator's state after each step of the current canvas.
    states_after_step: list[torch.Tensor] = field(default_factory=list)

    def slots(self, start: int, end: int, block_size: int) -> np.ndarray:
        pos = np.arange(start, end)
        return np.asarray(self.block_ids, dtype=np.int64)[pos // block_size] * block_size \
            + pos % block_size


@dataclass(eq=False)
class AsyncCanvasOutput(AsyncModelRunnerOutput):
    """A step's committed canvases, still being copied: row ``canvas_rows[i]`` of the
    copied [R, 1 + L] array (a commit flag, then the argmax canvas) is request i's."""

    canvas_rows: list[int] = field(default_factory=list)

    def get_output(self) -> ModelRunnerOutput:
        return canvas_output(self.req_ids, self.req_id_to_index, self.canvas_rows,
                             self.copy.wait()[0])


def canvas_output(req_ids: list[str], req_id_to_index: dict[str, int],
                  canvas_rows: list[int], commits: np.ndarray | None) -> ModelRunnerOutput:
    """Each request's committed canvas (all L tokens: the scheduler's stop checks end it
    at an EOS), or nothing."""
    sampled: list[list[int]] = []
    for row in canvas_rows:
        if row < 0 or commits is None or not commits[row, 0]:
            sampled.append([])
        else:
            sampled.append(commits[row, 1:].tolist())
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index=req_id_to_index,
                             sampled_token_ids=sampled)


class DiffusionModelRunner:
    # What the Worker reads of any runner: none of these apply to a diffusion model.
    kv_steps = None
    speculator = None
    pp_ring = None
    use_cuda_graphs = False

    def __init__(self, engine_config: EngineConfig, ctx: ParallelContext) -> None:
        mc = engine_config.model_config
        self.engine_config = engine_config
        self.model_config = mc
        self.ctx = ctx
        self.device = ctx.device
        self.block_size = engine_config.cache_config.block_size
        self.use_async_scheduling = engine_config.async_scheduling
        self.dtype = resolve_dtype(mc.dtype, self.device, mc.hf_config)
        diffusion = mc.diffusion_config
        self.canvas_length = diffusion.canvas_length
        self.params = diffusion.sampling
        self.sampler = DiffusionSampler(diffusion.sampling, diffusion.canvas_length,
                                        mc.vocab_size)
        self.requests: dict[str, DiffusionRequestState] = {}
        self.copier = AsyncOutputCopier(self.device)
        self.model: DiffusionGemmaForBlockDiffusion | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_denoised_rows = 0  # canvases the decoder ran
        # Rows of ended canvases are dropped (CPU: their flags are in memory) rather than
        # run as device-side no-ops (GPU: reading them would wait for the last step).
        self.skips_ended_rows = self.device.type == "cpu"
        self.num_skipped_rows = 0  # steps of ended canvases not run (CPU)

    # ---------------------------------------------------------------- setup
    def load_model(self, model: DiffusionGemmaForBlockDiffusion | None = None) -> None:
        mc = self.model_config
        self.model = model if model is not None else get_diffusion_model(
            mc.model, self.ctx, dtype=mc.dtype, max_model_len=mc.max_model_len)

    @property
    def loaded_model(self) -> DiffusionGemmaForBlockDiffusion:
        if self.model is None:
            raise RuntimeError("the model is not loaded; call load_model() first.")
        return self.model

    def kv_cache_bytes_per_block(self) -> int:
        return sum(a.cache_bytes_per_block(self.block_size, self.dtype)
                   for a in self.loaded_model.attention_layers)

    def state_cache_bytes(self) -> int:
        return 0

    def step_reserve_bytes(self) -> int:
        """Activations of a full token budget and the sampler's float32 logits and their
        temporaries for every canvas a step may hold."""
        text = self.model_config.text_config
        sched = self.engine_config.scheduler_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        width = int(text["hidden_size"]) * 4 + 3 * int(text["intermediate_size"])
        rows = min(sched.max_num_seqs * self.canvas_length, sched.max_num_batched_tokens)
        return (2 * sched.max_num_batched_tokens * width * elem
                + rows * self.model_config.vocab_size * 4 * 8 + FIXED_RESERVE_BYTES)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.kv_caches = []
        for attn in self.loaded_model.attention_layers:
            cache = allocate_kv_cache(num_blocks, self.block_size, attn.num_kv_heads,
                                      attn.head_dim, self.dtype, self.device,
                                      attn.latent_cache)
            attn.kv_cache = cache
            self.kv_caches.append(cache)

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput, *_: object, **__: object
                      ) -> ModelRunnerOutput | AsyncCanvasOutput:
        so = scheduler_output
        starts = self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        spec = so.scheduled_spec_decode_tokens
        encode: list[tuple[str, int, int]] = []
        canvases: list[tuple[str, int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            width = len(spec.get(rid, ()))
            start = starts[rid]
            if n > width:
                encode.append((rid, start, start + n - width))
            if width:
                assert width == self.canvas_length, f"{rid}: a canvas of {width}"
                canvases.append((rid, start + n - width))
        if encode:
            self._encode(encode)
        canvases = self._live_canvases(canvases, so.new_canvases)
        req_ids = list(so.num_scheduled_tokens)
        req_id_to_index = {rid: i for i, rid in enumerate(req_ids)}
        row_of = {rid: r for r, (rid, _) in enumerate(canvases)}
        canvas_rows = [row_of.get(rid, -1) for rid in req_ids]
        if not canvases:
            return canvas_output(req_ids, req_id_to_index, canvas_rows, None)
        commits = self._denoise(canvases, so.new_canvases)
        if not self.use_async_scheduling:
            return canvas_output(req_ids, req_id_to_index, canvas_rows,
                                 commits.cpu().numpy())  # the sync point of sync mode
        mask = np.array([r >= 0 for r in canvas_rows])
        return AsyncCanvasOutput(req_ids, req_id_to_index, mask, np.full(len(req_ids), -1),
                                 self.copier.start([commits]), has_logprobs=False,
                                 canvas_rows=canvas_rows)

    def sample_tokens(self, grammar_output: object) -> ModelRunnerOutput:
        raise RuntimeError("a diffusion model defers no sampling (no structured outputs).")

    def _update_states(self, so: SchedulerOutput) -> dict[str, int]:
        """Apply the diff; returns each scheduled request's first position this step."""
        gone = so.finished_req_ids | so.preempted_req_ids
        for rid in gone | {new.req_id for new in so.scheduled_new_reqs}:
            self.requests.pop(rid, None)  # a re-sent request is rebuilt from scratch
        starts: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            generator = None
            if new.sampling_params.seed is not None:  # its stream is reproduced
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_seed & 0xFFFF_FFFF_FFFF_FFFF)
            self.requests[new.req_id] = DiffusionRequestState(
                req_id=new.req_id, token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                block_ids=list(new.block_ids), generator=generator)
            starts[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests.get(rid)
            if state is None:
                raise ValueError(f"cached request {rid!r} is unknown to the worker.")
            state.block_ids.extend(cached.new_block_ids[i])
            starts[rid] = cached.num_computed_tokens[i]
        return starts

    def _metadata(self, rows: list[tuple[str, int, int]], causal: bool
                  ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and metadata of rows (request, first position, end); every row an
        sdpa span (attention/bidirectional.py)."""
        bs = self.block_size
        states = [self.requests[rid] for rid, _, _ in rows]
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        qsl[1:] = np.cumsum([end - start for _, start, end in rows])
        seq_lens = np.array([end for _, _, end in rows], dtype=np.int64)
        width = max(len(s.block_ids) for s in states)
        table = np.zeros((len(rows), width), dtype=np.int64)
        for i, s in enumerate(states):
            table[i, :len(s.block_ids)] = s.block_ids
        slots = np.concatenate([s.slots(start, end, bs)
                                for s, (_, start, end) in zip(states, rows, strict=True)])
        positions = np.concatenate([np.arange(start, end) for _, start, end in rows])
        meta = build_bidirectional_metadata(
            qsl, seq_lens, torch.from_numpy(slots).to(self.device), table, bs, causal=causal)
        return torch.from_numpy(positions).to(self.device), meta

    def _encode(self, rows: list[tuple[str, int, int]]) -> None:
        """Committed tokens into the cache: host ids where known, else the argmax of the
        canvas the request committed last (still on the device)."""
        pieces = []
        for rid, start, end in rows:
            state = self.requests[rid]
            known = min(end, len(state.token_ids))
            if start < known:
                pieces.append(torch.tensor(state.token_ids[start:known], dtype=torch.long,
                                           device=self.device))
            if end > known:
                canvas, first = state.canvas, state.canvas_start
                assert canvas is not None and first <= max(start, known) and end <= first + \
                    self.canvas_length, f"{rid}: positions {start}..{end} are no canvas"
                pieces.append(canvas.argmax_canvas[max(start, known) - first:end - first])
        positions, meta = self._metadata(rows, causal=True)
        self.loaded_model.encode(torch.cat(pieces), positions, meta)

    def _live_canvases(self, canvases: list[tuple[str, int]], new_canvases: dict[str, int]
                       ) -> list[tuple[str, int]]:
        """The canvases to run: on a CPU, those that have not ended (a step booked after
        the end of its canvas returns nothing either way). The CPU computed the flags with
        the last step, so reading them waits for nothing; a GPU would wait for that step,
        so there every row runs and an ended canvas's row is a no-op."""
        continuing = [rid for rid, _ in canvases if rid not in new_canvases]
        if not self.skips_ended_rows or not continuing:
            return canvases
        flags = torch.stack([flag for rid in continuing  # every started canvas has one
                             if (flag := self.requests[rid].ended) is not None])
        ended = {rid for rid, done in zip(continuing, flags.tolist(), strict=True) if done}
        self.num_skipped_rows += len(ended)
        return [(rid, start) for rid, start in canvases if rid not in ended]

    def _start_canvas(self, state: DiffusionRequestState, start: int,
                      previous_steps: int) -> None:
        if (state.generator is not None and previous_steps
                and len(state.states_after_step) > previous_steps):
            # Steps after the one that ended the last canvas drew for nothing: undo them.
            state.generator.set_state(state.states_after_step[previous_steps - 1])
        state.canvas = self.sampler.new_canvas(self.device, state.generator)
        state.canvas_start = start
        state.ended = torch.zeros((), dtype=torch.bool, device=self.device)
        state.states_after_step = []

    def _denoise(self, rows: list[tuple[str, int]], new_canvases: dict[str, int]
                 ) -> torch.Tensor:
        """One denoising step of every canvas; [R, 1 + L] on the device: whether this step
        ended the canvas, then its argmax."""
        L = self.canvas_length
        states = [self.requests[rid] for rid, _ in rows]
        self.num_denoised_rows += len(rows)
        for (rid, start), state in zip(rows, states, strict=True):
            if rid in new_canvases:
                self._start_canvas(state, start, new_canvases[rid])
            assert state.canvas is not None and state.canvas_start == start, (
                f"{rid}: a canvas at {start} was never started")
        current = [s.canvas for s in states if s.canvas is not None]
        conditioned = [c.self_conditioning_logits for c in current]
        logits_in = mask = None
        if any(c is not None for c in conditioned):
            vocab = self.model_config.vocab_size
            logits_in = torch.cat([c if c is not None else
                                   torch.zeros(L, vocab, device=self.device)
                                   for c in conditioned])
            mask = torch.tensor([c is not None for c in conditioned],
                                device=self.device).repeat_interleave(L)
        positions, meta = self._metadata([(rid, s, s + L) for rid, s in rows], causal=False)
        logits = self.loaded_model.denoise(torch.cat([c.canvas for c in current]), positions,
                                           meta, logits_in, mask)
        return self._step_canvases(states, logits)

    def _step_canvases(self, states: list[DiffusionRequestState], logits: torch.Tensor
                       ) -> torch.Tensor:
        """The sampler's step of every canvas, kept only where the canvas has not ended;
        [R, 1 + L]: whether this step ended it, then its argmax."""
        old = [s.canvas for s in states if s.canvas is not None]
        ended = torch.stack([s.ended for s in states if s.ended is not None])  # [R]
        new = self.sampler.step_batch(old, logits, [s.generator for s in states])
        if self.use_async_scheduling:
            for state in states:
                if state.generator is not None:
                    state.states_after_step.append(state.generator.get_state())
        # Dropped rows leave no ended canvas here; otherwise an ended one keeps its state.
        kept = new if self.skips_ended_rows else _keep_where(ended, old, new)
        max_steps = self.params.max_denoising_steps
        ends = torch.stack([c.stopped for c in new]) | torch.tensor(
            [c.steps_done >= max_steps for c in new], device=self.device)
        for state, canvas, now in zip(states, kept, ended | ends, strict=True):
            state.canvas, state.ended = canvas, now
        commit = (ends & ~ended).to(torch.long)
        return torch.cat((commit[:, None], torch.stack([c.argmax_canvas for c in kept])), dim=1)

    def shutdown(self) -> None:
        self.copier.shutdown()


def _keep_where(ended: torch.Tensor, old: list[CanvasState], new: list[CanvasState]
                ) -> list[CanvasState]:
    """Per canvas, ``old`` where it had ended (``ended`` [R], on the device), else
    ``new``: batched selects, no host read."""
    def pick(field: str, shape: tuple[int, ...]) -> list:
        fresh = [getattr(c, field) for c in new]
        if any(f is None for f in fresh):  # no history kept (adaptive stopping off)
            return fresh
        before = [b if b is not None else f
                  for b, f in zip((getattr(c, field) for c in old), fresh, strict=True)]
        return list(torch.where(ended.view(-1, *shape), torch.stack(before),
                                torch.stack(fresh)).unbind(0))

    canvas, argmax = pick("canvas", (1,)), pick("argmax_canvas", (1,))
    conditioning = pick("self_conditioning_logits", (1, 1))
    history = pick("argmax_history", (1, 1))
    return [replace(n, canvas=canvas[r], argmax_canvas=argmax[r],
                    self_conditioning_logits=conditioning[r], argmax_history=history[r],
                    stopped=n.stopped | o.stopped)
            for r, (o, n) in enumerate(zip(old, new, strict=True))]
