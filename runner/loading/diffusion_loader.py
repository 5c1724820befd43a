"""Build a diffusion language model (models/registry.py ``DIFFUSION_MODELS``) for one
rank and fill it from a Hugging Face folder's safetensors, through the same lazy reads as
every other model (model_loader.py)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, cast

from raylm.parallel.context import ParallelContext
from raylm.runner.loading.model_loader import WeightReadStats, iterate_weights, resolve_dtype
from raylm.runner.models.diffusion_gemma_config import DiffusionGemmaConfig
from raylm.runner.models.registry import get_diffusion_model_class

if TYPE_CHECKING:
    from raylm.runner.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion


def get_diffusion_model(model_dir: str, ctx: ParallelContext, dtype: str = "auto",
                        max_model_len: int = 0, stats: WeightReadStats | None = None
                        ) -> DiffusionGemmaForBlockDiffusion:
    """The model in eval mode, every weight read by name from ``model_dir``."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    cfg = DiffusionGemmaConfig.from_hf(hf)
    model_cls = cast("type[DiffusionGemmaForBlockDiffusion]",
                     get_diffusion_model_class(hf.get("architectures") or []))
    torch_dtype = resolve_dtype(dtype, ctx.device, hf)
    model = model_cls(cfg, ctx, torch_dtype, max(cfg.max_position_embeddings, max_model_len))
    model.load_weights(iterate_weights(model_dir, wanted=model.needs_weight, stats=stats))
    return model.eval()
