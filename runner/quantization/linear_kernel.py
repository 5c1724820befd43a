"""The quantized-linear CPU kernel (``csrc/quantized_linear.cpp``), built on first use."""

from __future__ import annotations

import functools
import os

from raylm.runner.cpp_build import load_cpp_operators

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc",
                       "quantized_linear.cpp")


@functools.cache
def load_quantized_linear_kernel() -> bool:
    """Whether ``torch.ops.raylm_quant.linear`` is there to call (built now if needed)."""
    return load_cpp_operators("raylm_quantized_linear", _SOURCE,
                              "dequantized weights")
