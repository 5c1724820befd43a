"""The CPU paged-attention kernel (``csrc/paged_attention.cpp``), built on first use.

On CPU the torch ragged kernel's gathers and softmax passes dominate attention; this
kernel reads each KV block in place (a task per token and KV head, online softmax). It is
compiled once per machine (runner/cpp_build.py); where it cannot be built, or with RAYLM_CPU_ATTENTION_KERNEL=0, the torch kernel runs.
"""

from __future__ import annotations

import functools
import os

from raylm.runner.cpp_build import load_cpp_operators
from raylm.scheduler.config import envs

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc",
                       "paged_attention.cpp")


@functools.cache
def load_cpu_attention_kernel() -> bool:
    """Build (or load the cached build of) the kernel into this process; whether
    ``torch.ops.raylm.paged_attention`` is there to call (runner/cpp_build.py)."""
    if not envs.cpu_attention_kernel():
        return False
    return load_cpp_operators("raylm_paged_attention", _SOURCE, "the torch kernel")
