"""The CPU paged-attention kernel (``csrc/paged_attention.cpp``), built on first use.

On CPU the torch ragged kernel's gathers and softmax passes dominate attention; this
kernel reads each KV block in place (a task per token and KV head, online softmax). It is
compiled once per machine into ``TORCH_EXTENSIONS_DIR`` and loaded by later processes;
where it cannot be built, or with RAYLM_CPU_ATTENTION_KERNEL=0, the torch kernel runs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os

from raylm.scheduler.config import envs

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc",
                       "paged_attention.cpp")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _put_ninja_on_path() -> None:
    """torch finds ninja on PATH; the ninja wheel's binary sits in the environment's bin
    folder, which is not on PATH unless the environment is activated."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def load_cpu_attention_kernel() -> bool:
    """Build (or load the cached build of) the kernel into this process; whether
    ``torch.ops.raylm.paged_attention`` is there to call. The build is tuned for this
    CPU (-march=native), so its name carries a hash of the CPU's flags, the source and the
    compiler flags: a cache folder shared by different machines never hands one the
    other's build, and a build of that name is always the current one. So once it exists
    it is loaded directly, without torch's build step, which takes a lock file in the
    build folder that a process killed while holding it would leave behind for every
    later process to wait on."""
    if not envs.cpu_attention_kernel():
        return False
    try:
        import torch
        from torch.utils import cpp_extension

        with open(_SOURCE, "rb") as f:
            source = f.read()
        tag = hashlib.sha1(_cpu_flags().encode() + source + " ".join(_CFLAGS).encode())
        name = f"raylm_paged_attention_{tag.hexdigest()[:12]}"
        built = os.path.join(cpp_extension._get_build_directory(name, verbose=False),
                             f"{name}.so")
        if os.path.isfile(built):
            torch.ops.load_library(built)
        else:
            _put_ninja_on_path()
            cpp_extension.load(name=name, sources=[_SOURCE], extra_cflags=_CFLAGS,
                               extra_ldflags=["-fopenmp"], is_python_module=False,
                               verbose=False)
    except Exception as exc:  # no compiler, no ninja, an unsupported platform
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch "
                       "kernel.", exc)
        return False
    return True
