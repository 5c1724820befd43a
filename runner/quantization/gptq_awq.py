"""GPTQ and AWQ checkpoints (4-bit, safetensors) decoded into codes with a scale and zero
per group of 32, the form the kernel runs (group_quantized.py).

Layouts, per linear of output size N and input size K, groups of G input features:
- GPTQ (AutoGPTQ / GPTQModel): ``qweight`` int32 [K/8, N], eight 4-bit codes of eight
  consecutive input features per int32 (feature 8i+j in bits 4j); ``qzeros`` int32
  [K/G, N/8], eight output features per int32 the same way; ``scales`` float16 [K/G, N];
  ``g_idx`` int32 [K], each input feature's group. w = scale * (code - zero), where the
  original ("gptq", v1) format stores each zero minus one and "gptq_v2" stores it as is.
- AWQ (AutoAWQ, GEMM): ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/G, N/8], eight
  output features per int32 in AWQ's order (bits 4j hold feature 8i + (0, 2, 4, 6, 1, 3, 5,
  7)[j]); ``scales`` float16 [K/G, N]; w = scale * (code - zero).
A group of G (a multiple of 32) becomes G/32 groups of 32 with the same scale and zero
(zero' = -scale * zero), exactly. Act-order GPTQ (``desc_act``: groups that are not runs of
consecutive features) stays in the checkpoint's order until packing (act_order.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from raylm.runner.quantization.act_order import ActOrderQuantized
from raylm.runner.quantization.fp8_checkpoint import combine_fp8_linears
from raylm.runner.quantization.group_quantized import GROUP_SIZE, GroupQuantized
from raylm.scheduler.config.checkpoint_quantization import FP8_METHODS, checkpoint_quantization

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [8 R, C]: row 8i+j from bits 4j of row i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)
    return ((packed.unsqueeze(1) >> shifts) & 15).reshape(-1, packed.shape[1])


def _unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> [R, 8 C]: column 8i + order[j] from bits 4j of column i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 1, 8)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 15  # [R, C, 8], nibble j
    if order is not None:
        inverse = [0] * 8
        for j, column in enumerate(order):
            inverse[column] = j
        nibbles = nibbles[..., inverse]
    return nibbles.reshape(packed.shape[0], -1)


def _to_groups_of_32(codes_kn: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                     group_size: int, kind: str) -> GroupQuantized:
    """codes [K, N], zeros and scales [K/G, N] -> GroupQuantized [N, K] (groups of 32)."""
    if group_size % GROUP_SIZE:
        raise ValueError(f"{kind} group_size={group_size} is not a multiple of {GROUP_SIZE}.")
    repeat = group_size // GROUP_SIZE
    scale = scales.float().repeat_interleave(repeat, dim=0)  # [K/32, N]
    zero = -scale * zeros.float().repeat_interleave(repeat, dim=0)
    return GroupQuantized(codes_kn.t().to(torch.uint8).contiguous(), scale.t().contiguous(),
                          zero.t().contiguous(), 4, kind)


def gptq_to_group(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor | None, group_size: int, v1_zeros: bool
                  ) -> GroupQuantized | ActOrderQuantized:
    codes = _unpack_rows(qweight)  # [K, N]
    k = codes.shape[0]
    zeros = _unpack_columns(qzeros) + (1 if v1_zeros else 0)  # [K/G, N]
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        scale = scales.float().t().contiguous()  # [N, groups]
        return ActOrderQuantized(codes.t().to(torch.uint8).contiguous(), g_idx.long(),
                                 scale, (-scale * zeros.float().t()).contiguous())
    return _to_groups_of_32(codes, zeros, scales, group_size, "GPTQ")


def awq_to_group(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int) -> GroupQuantized:
    codes = _unpack_columns(qweight, _AWQ_ORDER)  # [K, N]
    zeros = _unpack_columns(qzeros, _AWQ_ORDER)  # [K/G, N]
    return _to_groups_of_32(codes, zeros, scales, group_size, "AWQ")


_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}


def combine_quantized_linears(weights: Iterable[tuple[str, Any]], hf_config: Mapping[str, Any]
                              ) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each quantized linear's parts (``<prefix>.qweight`` ...)
    read and combined into one ``<prefix>.weight`` GroupQuantized (FP8: an Fp8Weight,
    fp8_checkpoint.py); other tensors as they are. A linear's parts are consecutive in a
    safetensors file (sorted names)."""
    method = checkpoint_quantization(hf_config)
    if method is None:
        yield from weights
        return
    if method in FP8_METHODS:
        yield from combine_fp8_linears(weights, hf_config)
        return
    qc = hf_config["quantization_config"]
    group_size = int(qc.get("group_size", 128))
    v1_zeros = qc.get("checkpoint_format", "gptq") == "gptq"
    parts = _PARTS[method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in parts:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[part] = tensor if isinstance(tensor, torch.Tensor) else tensor.read()
        # g_idx (optional) sorts before the others: the linear is whole at its scales.
        if all(p in got for p in parts if p != "g_idx"):
            del pending[prefix]
            if method == "gptq":
                yield f"{prefix}.weight", gptq_to_group(got["qweight"], got["qzeros"],
                                                        got["scales"], got.get("g_idx"),
                                                        group_size, v1_zeros)
            else:
                yield f"{prefix}.weight", awq_to_group(got["qweight"], got["qzeros"],
                                                       got["scales"], group_size)
    if pending:
        raise ValueError(f"{method} linears with missing parts: "
                         f"{ {p: sorted(v) for p, v in pending.items()} }.")
