"""Build a model for one rank and fill it from a Hugging Face folder's safetensors or a GGUF file."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import process_weights_after_loading
from raylm.runner.cpu_attention import load_cpu_attention_kernel
from raylm.runner.default_model import ensure_local_model
from raylm.runner.gguf_checkpoint import find_gguf_file, iterate_gguf_weights
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.registry import get_model_class
from raylm.scheduler import envs
from raylm.scheduler.engine_config import DTYPES, ModelConfig


def cpu_has_fast_bfloat16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """AVX512-BF16 or AMX-BF16 in the CPU flags: oneDNN then runs bf16 matmuls natively
    (vLLM-CPU's test for defaulting to bf16)."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def checkpoint_dtype(hf_config: dict) -> torch.dtype:
    """The dtype config.json declares (``dtype``, or the older ``torch_dtype``); float32
    when it declares none."""
    name = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    name = name.removeprefix("torch.")
    return getattr(torch, name) if name in DTYPES and name != "auto" else torch.float32


def resolve_dtype(dtype: str, device: torch.device, hf_config: dict | None = None,
                  fast_cpu_bfloat16: bool | None = None) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype, except that a float32 checkpoint runs in
    bfloat16 on CUDA, and on a CPU with native bf16 (AVX512-BF16 / AMX) unless
    RAYLM_CPU_AUTO_BFLOAT16=0 (vLLM-CPU does the same downcast); every other name of DTYPES
    is torch's own."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
    if dtype == "auto":
        ckpt = checkpoint_dtype(hf_config or {})
        if ckpt != torch.float32:
            return ckpt
        if device.type == "cuda":
            return torch.bfloat16
        if fast_cpu_bfloat16 is None:
            fast_cpu_bfloat16 = envs.cpu_auto_bfloat16() and cpu_has_fast_bfloat16()
        return torch.bfloat16 if fast_cpu_bfloat16 else torch.float32
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


def iterate_weights(model_dir: str, wanted: Callable[[str], bool] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor ``wanted`` accepts; the others are never read."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if wanted is None or wanted(name):
                    yield name, f.get_tensor(name)


def get_model(model_config: ModelConfig, ctx: ParallelContext) -> nn.Module:
    """The model for ``ctx``'s stage and TP shard, weights loaded, in eval mode."""
    ensure_local_model(model_config.model)  # a rank on a node that has not fetched it yet
    cfg = DecoderConfig.from_hf(model_config.hf_config)
    dtype = resolve_dtype(model_config.dtype, ctx.device, model_config.hf_config)
    model_cls = get_model_class(model_config.hf_config.get("architectures") or [])
    max_position = max(cfg.max_position_embeddings, model_config.max_model_len)
    model = model_cls(cfg, ctx, dtype, max_position)
    gguf_path = find_gguf_file(model_config.model)
    if gguf_path is not None:
        model.load_weights(iterate_gguf_weights(gguf_path, model_config.hf_config,
                                                wanted=model.needs_weight))
    else:
        model.load_weights(iterate_weights(model_config.model, wanted=model.needs_weight))
    process_weights_after_loading(model, envs.cpu_pack_linears())
    if ctx.device.type == "cpu":
        load_cpu_attention_kernel()  # built now (first use on this machine), not mid-step
    return model.eval()
