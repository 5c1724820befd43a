"""Diffusion language models' settings (docs/architecture.md §23): the canvas width, and
the denoising loop's parameters that transformers keeps in the checkpoint's generation
config. Pure Python: the scheduler books each canvas from them, the runner samples by them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

DIFFUSION_ARCHITECTURES = ("DiffusionGemmaForBlockDiffusion",)


@dataclass(frozen=True)
class DiffusionSamplingParams:
    """transformers' ``DiffusionGemmaGenerationConfig`` defaults."""

    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    # Adaptive stopping; None (either): every canvas runs all its steps.
    stability_threshold: int | None = 1
    confidence_threshold: float | None = 0.005

    def __post_init__(self) -> None:
        if self.max_denoising_steps < 1:
            raise ValueError(f"max_denoising_steps must be positive, got "
                             f"{self.max_denoising_steps}.")
        if not self.entropy_bound > 0:
            raise ValueError(f"entropy_bound must be positive, got {self.entropy_bound}.")
        if self.t_min < 0 or self.t_max <= self.t_min:
            raise ValueError(f"temperatures need 0 <= t_min < t_max, got t_min={self.t_min}, "
                             f"t_max={self.t_max}.")
        if self.stability_threshold is not None and self.stability_threshold < 0:
            raise ValueError(f"stability_threshold must be >= 0, got "
                             f"{self.stability_threshold}.")
        if self.confidence_threshold is not None and not self.confidence_threshold > 0:
            raise ValueError(f"confidence_threshold must be positive, got "
                             f"{self.confidence_threshold}.")

    @property
    def adaptive_stopping(self) -> bool:
        return self.stability_threshold is not None and self.confidence_threshold is not None


@dataclass(frozen=True)
class DiffusionConfig:
    """``canvas_length`` tokens are denoised together and committed at once."""

    canvas_length: int
    sampling: DiffusionSamplingParams = DiffusionSamplingParams()

    def __post_init__(self) -> None:
        if self.canvas_length < 1:
            raise ValueError(f"canvas_length must be positive, got {self.canvas_length}.")

    @property
    def max_denoising_steps(self) -> int:
        return self.sampling.max_denoising_steps

    @classmethod
    def from_checkpoint(cls, hf_config: dict[str, Any], model_dir: str | None) -> DiffusionConfig:
        """The checkpoint's ``canvas_length`` and the set fields of its
        ``generation_config.json`` (unset ones keep transformers' defaults)."""
        text = hf_config.get("text_config") or {}
        if text.get("use_bidirectional_attention") == "all":
            raise ValueError("text_config.use_bidirectional_attention='all' is not supported "
                             "(the encoder runs causally; only the decoder's canvas is "
                             "bidirectional).")
        fields: dict[str, Any] = {}
        path = os.path.join(model_dir, "generation_config.json") if model_dir else ""
        if path and os.path.isfile(path):
            with open(path) as f:
                generation = json.load(f)
            for name in ("max_denoising_steps", "t_min", "t_max", "stability_threshold",
                         "confidence_threshold"):
                if generation.get(name) is not None:
                    fields[name] = generation[name]
            sampler = generation.get("sampler_config") or {}
            if sampler.get("entropy_bound") is not None:
                fields["entropy_bound"] = sampler["entropy_bound"]
        return cls(canvas_length=int(hf_config.get("canvas_length", 0)),
                   sampling=DiffusionSamplingParams(**fields))
