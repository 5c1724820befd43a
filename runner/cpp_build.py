"""Builds the project's C++ CPU operators (attention, quantized linears) on first use.

Each source is compiled once per machine into ``TORCH_EXTENSIONS_DIR`` and loaded by later
processes. The build is tuned for this CPU (-march=native), so its name carries a hash of
the CPU's flags, the source and the compiler flags: a cache folder shared by different
machines never hands one the other's build, and a build of that name is always the current
one. So once it exists it is loaded directly, without torch's build step, which takes a
lock file in the build folder that a process killed while holding it would leave behind
for every later process to wait on.
"""

from __future__ import annotations

import hashlib
import logging
import os

logger = logging.getLogger(__name__)

_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


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


def load_cpp_operators(prefix: str, source: str, what: str) -> bool:
    """Build (or load the cached build of) ``source`` into this process; whether its
    operators are there to call. ``what`` names the fallback in the warning when the
    build fails (no compiler, no ninja, an unsupported platform)."""
    try:
        import torch
        from torch.utils import cpp_extension

        with open(source, "rb") as f:
            text = f.read()
        tag = hashlib.sha1(_cpu_flags().encode() + text + " ".join(_CFLAGS).encode())
        name = f"{prefix}_{tag.hexdigest()[:12]}"
        built = os.path.join(cpp_extension._get_build_directory(name, verbose=False),
                             f"{name}.so")
        if os.path.isfile(built):
            torch.ops.load_library(built)
        else:
            _put_ninja_on_path()
            cpp_extension.load(name=name, sources=[source], extra_cflags=_CFLAGS,
                               extra_ldflags=["-fopenmp"], is_python_module=False,
                               verbose=False)
    except Exception as exc:
        logger.warning("C++ operators %s unavailable (%s); using %s.", prefix, exc, what)
        return False
    return True
