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
Each linear reaches the loaders unread, a GptqAwqShard (gptq_awq_shard.py): a TP rank
reads only the packed rows and columns of its shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from raylm.runner.quantization.fp8_checkpoint import combine_fp8_linears
from raylm.runner.quantization.gptq_awq_shard import GptqAwqShard
from raylm.scheduler.config.checkpoint_quantization import FP8_METHODS, checkpoint_quantization

_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}


def combine_quantized_linears(weights: Iterable[tuple[str, Any]], hf_config: Mapping[str, Any]
                              ) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each quantized linear's parts (``<prefix>.qweight`` ...)
    combined, unread, into one ``<prefix>.weight`` GptqAwqShard (FP8: an Fp8Shard,
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
    pending: dict[str, dict[str, Any]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in parts:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[part] = tensor
        # g_idx (optional) sorts before the others: the linear is whole at its scales.
        if all(p in got for p in parts if p != "g_idx"):
            del pending[prefix]
            yield f"{prefix}.weight", GptqAwqShard(f"{prefix}.weight", method, got,
                                                   group_size, v1_zeros)
    if pending:
        raise ValueError(f"{method} linears with missing parts: "
                         f"{ {p: sorted(v) for p, v in pending.items()} }.")
