"""One request's denoising steps over its canvas: transformers' DiffusionGemma generation
loop (``generation_diffusion_gemma.py``) for one sequence, step by step, so that the
engine can batch steps of many requests (docs/architecture.md §23).

Per canvas: a uniform random canvas; then per step, with ``cur_step`` counting down from
``max_denoising_steps`` to 1: the logits divided by a temperature falling linearly from
``t_max`` to ``t_min``; a token sampled per position; the lowest-entropy positions
accepted while their summed entropy, less the largest, stays within ``entropy_bound``;
every other position renoised uniformly; the scaled logits kept to condition the next
step. The canvas ends when its argmax is unchanged for ``stability_threshold`` steps and
its mean entropy is under ``confidence_threshold`` (adaptive stopping), or after the last
step; its argmax is then committed.

Random draws, per request and in transformers' order: the canvas (``randint``), then per
step the samples (``multinomial`` over the canvas's rows) and the renoising canvas
(``randint``, drawn even when every position was accepted). A request's own
``torch.Generator`` seeded with its seed draws what ``torch.manual_seed(seed)`` and
transformers' ``generate`` draw for one sequence; a request without a seed draws from the
global generator, batched with the others (``_draw``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from raylm.scheduler.config.diffusion_config import DiffusionSamplingParams

__all__ = ["CanvasState", "DiffusionSampler", "DiffusionSamplingParams", "committed_tokens"]


@dataclass(frozen=True)
class CanvasState:
    """One request's canvas between two denoising steps; every tensor stays on the
    device (a step reads nothing back to the host)."""

    canvas: torch.Tensor  # [L] the next step's input (accepted tokens, the rest noise)
    argmax_canvas: torch.Tensor  # [L] the latest argmax prediction: what is committed
    # [L, vocab] the last step's temperature-scaled logits; None before the first step
    self_conditioning_logits: torch.Tensor | None
    steps_done: int
    # [stability_threshold, L] the last steps' argmax canvases (-1 before any)
    argmax_history: torch.Tensor | None
    stopped: torch.Tensor  # [] bool: adaptive stopping fired

    def finished(self, params: DiffusionSamplingParams) -> bool:
        """Whether the canvas is ready to commit (a host read of ``stopped``)."""
        return self.steps_done >= params.max_denoising_steps or bool(self.stopped)


class DiffusionSampler:
    def __init__(self, params: DiffusionSamplingParams, canvas_length: int,
                 vocab_size: int) -> None:
        self.params = params
        self.canvas_length = canvas_length
        self.vocab_size = vocab_size

    def _noise(self, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
        # Shape (1, L) as transformers draws for one sequence.
        return torch.randint(0, self.vocab_size, (1, self.canvas_length), device=device,
                             generator=generator)[0]

    def new_canvas(self, device: torch.device,
                   generator: torch.Generator | None = None) -> CanvasState:
        """A canvas of uniform random tokens (a block's start)."""
        canvas = self._noise(device, generator)
        return CanvasState(canvas=canvas, argmax_canvas=canvas, self_conditioning_logits=None,
                           steps_done=0, argmax_history=None,
                           stopped=torch.zeros((), dtype=torch.bool, device=device))

    def _temperature(self, cur_step: torch.Tensor) -> torch.Tensor:
        # transformers passes cur_step as an int32 tensor: the ratio is float32 arithmetic.
        p = self.params
        return p.t_min + ((p.t_max - p.t_min) * (cur_step / p.max_denoising_steps))

    def step(self, state: CanvasState, logits: torch.Tensor,
             generator: torch.Generator | None = None,
             self_conditioning_dtype: torch.dtype | None = None) -> CanvasState:
        """The state after one step whose decoder gave ``logits`` [L, vocab] (float32)."""
        return self.step_batch([state], logits, [generator], self_conditioning_dtype)[0]

    def step_batch(self, states: list[CanvasState], logits: torch.Tensor,
                   generators: list[torch.Generator | None],
                   self_conditioning_dtype: torch.dtype | None = None) -> list[CanvasState]:
        """One step of R canvases whose decoder gave ``logits`` [R * L, vocab] (float32):
        every operation batched over the canvases (each row's values as one canvas's
        alone: row-wise reductions), the draws from each canvas's own generator, in its
        order (its samples, then its renoising canvas)."""
        p = self.params
        R, L = len(states), self.canvas_length
        device = logits.device
        cur_step = torch.tensor([p.max_denoising_steps - s.steps_done for s in states],
                                device=device, dtype=torch.int32)
        scaled = logits.view(R, L, -1) / self._temperature(cur_step)[:, None, None]
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
        sampled, noise = self._draw(probs, generators)
        argmax = torch.argmax(scaled, dim=-1)
        entropy = _entropy(scaled)  # [R, L]
        accepted = self._accepted(entropy)
        kept = torch.where(accepted, sampled, torch.stack([s.canvas for s in states]))
        canvas = torch.where(~accepted, noise, kept)
        stopped = torch.stack([s.stopped for s in states])
        history: list[torch.Tensor | None] = [s.argmax_history for s in states]
        if p.stability_threshold is not None and p.confidence_threshold is not None:
            stacked, stable = self._stable(history, argmax, p.stability_threshold)
            confident = entropy.mean(dim=-1) < p.confidence_threshold
            stopped = stopped | (stable & confident)
            history = list(stacked.unbind(0))
        conditioning = scaled.to(self_conditioning_dtype or scaled.dtype)
        return [replace(s, canvas=canvas[r], argmax_canvas=argmax[r],
                        self_conditioning_logits=conditioning[r], steps_done=s.steps_done + 1,
                        argmax_history=history[r], stopped=stopped[r])
                for r, s in enumerate(states)]

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, L] a token sampled per position, [R, L] a renoising canvas). A canvas with
        a generator draws as transformers does (``multinomial``, whose exponential race
        costs ~20 ns a vocabulary entry, then ``randint``); the others, whose stream no
        one reproduces, draw the same distributions from the global generator in two
        batched calls (the race over -log of uniform samples, ~6x cheaper)."""
        R, L, V = probs.shape
        device = probs.device
        sampled = torch.empty((R, L), dtype=torch.long, device=device)
        noise = torch.empty((R, L), dtype=torch.long, device=device)
        free = [r for r, g in enumerate(generators) if g is None]
        if free:
            rows = torch.tensor(free, device=device)
            race = torch.rand((len(free), L, V), device=device).log_().neg_()
            sampled[rows] = (probs[rows] / race).argmax(dim=-1)
            noise[rows] = torch.randint(0, self.vocab_size, (len(free), L), device=device)
        for r, generator in enumerate(generators):
            if generator is not None:
                sampled[r] = torch.multinomial(probs[r], num_samples=1,
                                               generator=generator).squeeze(-1)
                noise[r] = self._noise(device, generator)
        return sampled, noise

    def _accepted(self, entropy: torch.Tensor) -> torch.Tensor:
        """[R, L] bool: per canvas, the lowest-entropy positions whose summed entropy,
        less the largest of them, stays within the bound (near-independent tokens)."""
        ordered, order = torch.sort(entropy, dim=-1, descending=False)
        selected = torch.cumsum(ordered, dim=-1) - ordered <= self.params.entropy_bound
        return torch.scatter(torch.zeros_like(selected), -1, order, selected)

    @staticmethod
    def _stable(history: list[torch.Tensor | None], argmax: torch.Tensor, threshold: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, threshold, L] each history with its ``argmax`` [R, L] appended, [R]
        whether each equals each of its last ``threshold`` ones)"""
        R, L = argmax.shape
        if threshold == 0:
            return argmax.new_full((R, 0, L), -1), torch.ones(
                R, dtype=torch.bool, device=argmax.device)
        before = torch.stack([h if h is not None else argmax.new_full((threshold, L), -1)
                              for h in history])
        stable = (before == argmax[:, None, :]).flatten(1).all(dim=-1)
        return torch.cat([before[:, 1:], argmax[:, None, :]], dim=1), stable


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    # torch's Categorical, as transformers computes it (the same float operations).
    return torch.distributions.Categorical(logits=logits).entropy()


def committed_tokens(argmax_canvas: torch.Tensor,
                     eos_token_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """A finished canvas's tokens up to and including its first EOS, and whether it had
    one (the request then ends at this canvas; transformers pads the rest)."""
    tokens = argmax_canvas.tolist()
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[:i + 1], True
    return tokens, False
