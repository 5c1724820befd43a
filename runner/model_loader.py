"""Build a model for one rank and fill it from the Hugging Face folder's safetensors."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.registry import get_model_class
from raylm.scheduler.engine_config import DTYPES, ModelConfig


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> float32 on CPU (no fast bf16 matmul there), bfloat16 on CUDA; every other
    name of DTYPES is torch's own."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def safetensors_files(model_dir: str) -> list[str]:
    """The shards named by model.safetensors.index.json if present, else every *.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in files]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model {model_dir!r} has no *.safetensors files.")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def get_model(model_config: ModelConfig, ctx: ParallelContext) -> nn.Module:
    """The model for ``ctx``'s stage and TP shard, weights loaded, in eval mode."""
    cfg = DecoderConfig.from_hf(model_config.hf_config)
    dtype = resolve_dtype(model_config.dtype, ctx.device)
    model_cls = get_model_class(model_config.hf_config.get("architectures") or [])
    max_position = max(cfg.max_position_embeddings, model_config.max_model_len)
    model = model_cls(cfg, ctx, dtype, max_position)
    model.load_weights(iterate_weights(model_config.model))
    return model.eval()
