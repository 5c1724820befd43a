"""A Hugging Face checkpoint's ``quantization_config``: which method raylm runs it with, or
a ValueError naming what it cannot run (never ignored: a quantized checkpoint read as
dense would be garbage).

FP8 layouts read (weights float8_e4m3fn, scales float32, w = fp8 x scale):
- ``quant_method: "fp8"`` (transformers' FineGrainedFP8, DeepSeek-V3, vLLM's fp8): with
  ``weight_block_size: [bn, bk]``, ``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)] per block;
  without it, one scale per tensor (``weight_scale_inv`` or ``weight_scale``, a scalar) or
  per output channel ([N] or [N, 1]);
- ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` and config
  groups of 8-bit float weights, strategy ``tensor``, ``channel`` or ``block``
  (``block_structure``): ``weight_scale`` shaped as above.
Activation scales (``input_scale``, ``activation_scale``; static or dynamic schemes) are
not applied: raylm runs these weight-only, activations unquantized (as vLLM's weight-only
FP8 path does on GPUs without FP8 matmuls).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CHECKPOINT_METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
FP8_METHODS = ("fp8", "compressed-tensors")


def _refuse(method: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config quant_method={method!r} with {field}={value!r} is "
                      f"not supported; {why}.")


def _block(method: str, field: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise _refuse(method, field, value, "two positive integers [rows, columns] are")
    return int(value[0]), int(value[1])


def _compressed_tensors_block(qc: Mapping[str, Any]) -> tuple[int, int] | None:
    method = "compressed-tensors"
    if qc.get("format") != "float-quantized":
        raise _refuse(method, "format", qc.get("format"), "raylm reads 'float-quantized' (FP8)")
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse(method, "kv_cache_scheme", qc.get("kv_cache_scheme"),
                      "a quantized KV cache is not read")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse(method, "config_groups", groups, "at least one group is needed")
    blocks = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        for field, want in (("type", "float"), ("num_bits", 8), ("symmetric", True),
                            ("dynamic", False)):
            if w.get(field, want) != want:
                raise _refuse(method, f"config_groups.{name}.weights.{field}", w.get(field),
                              f"only {want!r} (FP8 weights with stored scales)")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(method, f"config_groups.{name}.weights.strategy", strategy,
                          "raylm reads 'tensor', 'channel' and 'block'")
        blocks.add(_block(method, f"config_groups.{name}.weights.block_structure",
                          w.get("block_structure")) if strategy == "block" else None)
    if len(blocks) > 1:
        raise _refuse(method, "config_groups", sorted(groups), "their block structures differ")
    return blocks.pop()


def fp8_weight_block(hf_config: Mapping[str, Any]) -> tuple[int, int] | None:
    """An FP8 checkpoint's scale block [rows, columns], or None (per-tensor or per-channel
    scales, told apart by their shape)."""
    qc = hf_config["quantization_config"]
    if qc.get("quant_method") == "compressed-tensors":
        return _compressed_tensors_block(qc)
    return _block("fp8", "weight_block_size", qc.get("weight_block_size"))


def _check_fp8(hf_config: Mapping[str, Any]) -> None:
    qc = hf_config["quantization_config"]
    method = qc["quant_method"]
    if method == "fp8":
        if qc.get("bits", 8) != 8:
            raise _refuse(method, "bits", qc.get("bits"), "FP8 weights are 8 bits")
        if str(qc.get("activation_scheme", "dynamic")).lower() not in ("dynamic", "static"):
            raise _refuse(method, "activation_scheme", qc.get("activation_scheme"),
                          "'dynamic' or 'static' (weight-only here)")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _refuse(method, "fmt", qc.get("fmt"), "raylm reads float8_e4m3fn weights")
        if qc.get("scale_fmt", "float") != "float":
            raise _refuse(method, "scale_fmt", qc.get("scale_fmt"), "only float32 scales")
        if qc.get("dequantize"):
            raise _refuse(method, "dequantize", qc.get("dequantize"),
                          "pass quantization='none' to dequantize at load")
    fp8_weight_block(hf_config)


def checkpoint_quantization(hf_config: Mapping[str, Any]) -> str | None:
    """``"gptq"``, ``"awq"``, ``"fp8"``, ``"compressed-tensors"`` or None (no
    quantization_config)."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config quant_method={method!r} is not supported; "
                         f"raylm runs {CHECKPOINT_METHODS} checkpoints and GGUF files.")
    if method in FP8_METHODS:
        _check_fp8(hf_config)
        return str(method)
    if qc.get("bits", 4) != 4:
        raise ValueError(f"{method} bits={qc.get('bits')} is not supported; only 4.")
    group = int(qc.get("group_size", 128))
    if group <= 0 or group % 32:
        raise ValueError(f"{method} group_size={group} is not supported; a positive multiple "
                         "of 32 is.")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version={qc.get('version')!r} is not supported; only 'gemm'.")
    return str(method)
