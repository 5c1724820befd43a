"""CPU workers keep freed host memory mapped (glibc, Linux): after Worker.init_device a
30 MB block comes from the heap, which glibc keeps and reuses, instead of a fresh mmap
whose pages fault in again on every use; RAYLM_CPU_KEEP_FREED_MEMORY=0 leaves glibc's
defaults. (The effect on a generate() run, ~50k minor faults down to a few thousand, is
measured by hand; fault counts are too noisy for a test.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

_SCRIPT = r"""
import ctypes, sys
from raylm.cluster.engine_args import EngineArgs
from raylm.runner.worker import Worker

Worker(EngineArgs(model=sys.argv[1]).create_engine_config()).init_device(num_threads=1)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = [ctypes.c_ssize_t]
block = libc.malloc(30 << 20)
print("heap" if block < libc.sbrk(0) else "mmap")
"""


def _placement(model_path: str, keep: str) -> str:
    env = dict(os.environ, RAYLM_CPU_KEEP_FREED_MEMORY=keep)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, model_path], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1]


def test_cpu_worker_keeps_large_blocks_on_the_heap(llama_path):
    assert _placement(llama_path, "0") == "mmap"
    assert _placement(llama_path, "1") == "heap"
