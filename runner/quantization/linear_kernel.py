"""The quantized-linear CPU kernels (``csrc/quantized_linear.cpp`` for integer codes,
``csrc/fp8_linear.cpp`` for FP8 bytes), each built on first use."""

from __future__ import annotations

import functools
import os

from raylm.runner.cpp_build import load_cpp_operators

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


@functools.cache
def load_quantized_linear_kernel() -> bool:
    """Whether ``torch.ops.raylm_quant.linear`` is there to call (built now if needed)."""
    return load_cpp_operators("raylm_quantized_linear",
                              os.path.join(_CSRC, "quantized_linear.cpp"), "dequantized weights")


@functools.cache
def load_fp8_linear_kernel() -> bool:
    """Whether ``torch.ops.raylm_fp8.linear`` is there to call (built now if needed)."""
    return load_cpp_operators("raylm_fp8_linear", os.path.join(_CSRC, "fp8_linear.cpp"),
                              "dequantized weights")
