"""After a model's weights are loaded: its quantized shards packed for the kernel.

A layer whose quantized shards cover its whole weight (all group-quantized, or all FP8) runs
quantized, 4-bit parts beside 8-bit ones all as 8-bit codes (a Q4_K_M file's merged q/k/v:
Q4_K q and k, Q6_K v); one whose weight arrived partly dense (a part in a type that has no
group form) or mixes FP8 with group-quantized parts has its shards dequantized into the
dense weight and runs dense.
A tied LM head on the embedding's stage shares the embedding's packed weight.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from raylm.parallel.layers import QuantizableWeight, QuantizedShard
from raylm.runner.quantization.act_order import ActOrderQuantized
from raylm.runner.quantization.fp8_linear import Fp8Linear
from raylm.runner.quantization.fp8_weight import Fp8Weight, concat_fp8_rows
from raylm.runner.quantization.gguf_blocks import LazyGGUFBlocks
from raylm.runner.quantization.group_quantized import GroupQuantized, concat_rows
from raylm.runner.quantization.lazy_shard import LazyQuantizedShard
from raylm.runner.quantization.packed_linear import PackedLinear
from raylm.scheduler.config import envs

if TYPE_CHECKING:
    from raylm.runner.quantization.triton_fp8_linear import TritonFp8Linear
    from raylm.runner.quantization.triton_linear import TritonQuantLinear

    Packed = PackedLinear | TritonQuantLinear | Fp8Linear | TritonFp8Linear

logger = logging.getLogger(__name__)


def _read(shard: QuantizedShard) -> QuantizedShard:
    """A lazy shard (GGUF blocks, a GPTQ/AWQ or FP8 linear) read now: only the rows and
    columns its rank's loader kept."""
    if isinstance(shard, LazyGGUFBlocks | LazyQuantizedShard):
        return shard.decode()
    return shard


def _as_group(shard: QuantizedShard) -> GroupQuantized:
    """The shard in the group form the kernel packs."""
    if isinstance(shard, ActOrderQuantized):  # sorted now that the rank's slice is known
        return shard.to_group()
    if not isinstance(shard, GroupQuantized):
        raise TypeError(f"a quantized shard of type {type(shard).__name__} has no packer.")
    return shard


def _covers(parts: list[tuple[int, QuantizedShard]], rows: int) -> bool:
    end = 0
    for offset, shard in parts:
        if offset != end:
            return False
        end += shard.shape[0]
    return end == rows


def triton_runs_quantized(device: torch.device) -> bool:
    """Whether quantized weights on ``device`` run on the Triton kernel (CUDA, or a CPU
    test under TRITON_INTERPRET=1 with RAYLM_QUANT_BACKEND=triton)."""
    backend = envs.quant_backend()
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


def quantized_linear(weight: GroupQuantized, device: torch.device
                     ) -> PackedLinear | TritonQuantLinear:
    if triton_runs_quantized(device):
        from raylm.runner.quantization.triton_linear import TritonQuantLinear

        return TritonQuantLinear(weight, device)
    return PackedLinear(weight)


def fp8_linear(weight: Fp8Weight, device: torch.device) -> Fp8Linear | TritonFp8Linear:
    if triton_runs_quantized(device):
        from raylm.runner.quantization.triton_fp8_linear import TritonFp8Linear

        return TritonFp8Linear(weight, device)
    return Fp8Linear(weight)


def _packed(parts: list[tuple[int, QuantizedShard]], rows: int, device: torch.device
            ) -> Packed | None:
    """The layer's shards packed, or None where they cannot run as one kernel."""
    if not _covers(parts, rows):
        return None
    shards = [s for _, s in parts]
    fp8 = [isinstance(s, Fp8Weight) for s in shards]
    if all(fp8):
        return fp8_linear(concat_fp8_rows(cast("list[Fp8Weight]", shards)), device)
    if any(fp8):
        return None
    return quantized_linear(concat_rows([_as_group(s) for s in shards]), device)


def pack_quantized_weights(model: nn.Module) -> Counter[str]:
    """Pack every layer's quantized shards; what each layer runs, counted by path (for the
    startup log: ``"Q4_1 4-bit kernel"``, ``"dense (partly Q4_K)"``, ...)."""
    paths: Counter[str] = Counter()
    # by id of the dense parameter (tied weights)
    packed: dict[int, Packed] = {}
    for module in model.modules():
        if not isinstance(module, QuantizableWeight):
            continue
        weight = module.weight
        parts = [(offset, _read(shard))
                 for offset, shard in sorted(module.quantized_parts, key=lambda p: p[0])]
        module.quantized_parts.clear()
        if not parts:
            if id(weight) in packed:
                module.quantized = packed[id(weight)]
                paths[f"{packed[id(weight)].kind} {packed[id(weight)].bits}-bit kernel"] += 1
            continue
        linear = _packed(parts, weight.shape[0], weight.device)
        if linear is not None:
            module.quantized = linear
            packed[id(weight)] = linear
            # The dense parameter is never read again but for its shape and dtype.
            weight.data = torch.empty((), dtype=weight.dtype,
                                      device=weight.device).expand(weight.shape)
            paths[f"{linear.kind} {linear.bits}-bit kernel"] += 1
            continue
        for offset, shard in parts:
            weight.data.narrow(0, offset, shard.shape[0]).copy_(shard.dequantize(weight.dtype))
        paths["dense (partly " + "+".join(sorted({s.kind for _, s in parts})) + ")"] += 1
    return paths


def log_weight_paths(paths: Counter[str], where: str) -> None:
    if paths:
        logger.info("%s: quantized weights run as %s", where,
                    ", ".join(f"{n} x {path}" for path, n in sorted(paths.items())))
