"""FP8 checkpoints (scheduler/config/checkpoint_quantization.py lists the layouts): each
linear's float8_e4m3fn ``weight`` and its scale tensor combined into one Fp8Shard, read per
TP rank (fp8_shard.py) into an Fp8Weight, the scales spread per output feature
(fp8_weight.py); activation scales dropped (weight-only).
Tensors that are not FP8 (norms, an unquantized embedding or LM head) pass as they are."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from raylm.runner.quantization.fp8_shard import Fp8Shard
from raylm.scheduler.config.checkpoint_quantization import fp8_weight_block

_SCALES = ("weight_scale_inv", "weight_scale")  # FineGrainedFP8's name, vLLM's and CT's
_ACTIVATION_SCALES = ("input_scale", "activation_scale")


def combine_fp8_linears(weights: Iterable[tuple[str, Any]], hf_config: Mapping[str, Any]
                        ) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each FP8 ``<prefix>.weight`` and its scale combined into
    one ``<prefix>.weight`` Fp8Shard, unread (yielded when both have come, whatever their
    order; a TP rank reads only its shard, fp8_shard.py); other tensors as they are."""
    block = fp8_weight_block(hf_config)
    codes: dict[str, Any] = {}
    scales: dict[str, Any] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in _ACTIVATION_SCALES:
            continue
        if part == "weight" and getattr(tensor, "dtype", None) in (torch.float8_e4m3fn,
                                                                    torch.float8_e5m2):
            if tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name}: dtype {tensor.dtype}; FP8 weights are read as "
                                 "float8_e4m3fn.")
            codes[prefix] = tensor
        elif part in _SCALES:
            scales[prefix] = tensor
        else:
            yield name, tensor
            continue
        if prefix in codes and prefix in scales:
            yield f"{prefix}.weight", Fp8Shard(f"{prefix}.weight", codes.pop(prefix),
                                               scales.pop(prefix), block)
    if codes or scales:
        raise ValueError(f"FP8 weights without scales: {sorted(codes)}; scales without "
                         f"weights: {sorted(scales)}.")
