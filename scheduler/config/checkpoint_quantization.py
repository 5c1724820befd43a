"""A Hugging Face checkpoint's ``quantization_config``: which method raylm runs it with, or
a ValueError naming what it cannot run (never ignored: a quantized checkpoint read as
dense would be garbage)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CHECKPOINT_METHODS = ("gptq", "awq")


def checkpoint_quantization(hf_config: Mapping[str, Any]) -> str | None:
    """``"gptq"``, ``"awq"`` or None (no quantization_config)."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config quant_method={method!r} is not supported; "
                         f"raylm runs {CHECKPOINT_METHODS} (4-bit) checkpoints and GGUF files.")
    if qc.get("bits", 4) != 4:
        raise ValueError(f"{method} bits={qc.get('bits')} is not supported; only 4.")
    group = int(qc.get("group_size", 128))
    if group <= 0 or group % 32:
        raise ValueError(f"{method} group_size={group} is not supported; a positive multiple "
                         "of 32 is.")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version={qc.get('version')!r} is not supported; only 'gemm'.")
    return str(method)
