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
transformers' ``generate`` draw for one sequence; without one, the global generator.
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
        p = self.params
        device = logits.device
        cur_step = torch.tensor(p.max_denoising_steps - state.steps_done, device=device,
                                dtype=torch.int32)
        scaled = logits / self._temperature(cur_step)
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
        sampled = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
        argmax = torch.argmax(scaled, dim=-1)
        accepted = self._accepted(scaled)
        kept = torch.where(accepted, sampled, state.canvas)
        canvas = torch.where(~accepted, self._noise(device, generator), kept)
        history, stopped = state.argmax_history, state.stopped
        if p.stability_threshold is not None and p.confidence_threshold is not None:
            history, stable = self._stable(history, argmax, p.stability_threshold)
            confident = _entropy(scaled).mean(dim=-1) < p.confidence_threshold
            stopped = stopped | (stable & confident)
        dtype = self_conditioning_dtype or scaled.dtype
        return replace(state, canvas=canvas, argmax_canvas=argmax,
                       self_conditioning_logits=scaled.to(dtype),
                       steps_done=state.steps_done + 1, argmax_history=history,
                       stopped=stopped)

    def _accepted(self, scaled: torch.Tensor) -> torch.Tensor:
        """[L] bool: the lowest-entropy positions whose summed entropy, less the largest
        of them, stays within the bound (near-independent tokens)."""
        entropy = _entropy(scaled)
        ordered, order = torch.sort(entropy, dim=-1, descending=False)
        selected = torch.cumsum(ordered, dim=-1) - ordered <= self.params.entropy_bound
        return torch.scatter(torch.zeros_like(selected), -1, order, selected)

    @staticmethod
    def _stable(history: torch.Tensor | None, argmax: torch.Tensor, threshold: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the history with ``argmax`` appended, whether ``argmax`` equals each of the
        last ``threshold`` ones)"""
        if threshold == 0:
            return argmax.new_full((0, argmax.shape[0]), -1), torch.ones(
                (), dtype=torch.bool, device=argmax.device)
        if history is None:
            history = argmax.new_full((threshold, argmax.shape[0]), -1)
        stable = (history == argmax[None, :]).all()
        return torch.cat([history[1:], argmax[None, :]]), stable


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
