"""CPU workers keep freed host memory mapped (glibc, Linux): after Worker.init_device a
30 MB block comes from the heap, which glibc keeps and reuses, instead of a fresh mmap
whose pages fault in again on every use; RAYLM_CPU_KEEP_FREED_MEMORY=0 leaves glibc's
defaults. (The effect on a generate() run, ~50k minor faults down to a few thousand, is
measured by hand; fault counts are too noisy for a test.) The KV cache's own mapping:
zeros either way; prefaulted, its pages are resident at once, else only once written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

_SCRIPT = r"""
import ctypes, sys
from raylm.cluster.engine.engine_args import EngineArgs
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


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (always / madvise / never), "" without THP."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_cpu_kv_cache_is_zeroed_writable_and_in_huge_pages(monkeypatch):
    import gc

    import torch

    from raylm.runner.attention.paged_attention import allocate_kv_cache

    monkeypatch.setenv("RAYLM_CPU_KV_PREFAULT", "1")  # the default the suite turns off
    # 64 MiB per tensor: 32 blocks of 2 MiB, most of them whole huge pages.
    key, value = allocate_kv_cache(2048, 32, 8, 64, torch.float32, "cpu")
    assert key.shape == value.shape == (2048, 8, 32, 64) and key.dtype == torch.float32
    assert key.is_contiguous() and int(key.count_nonzero()) == int(value.count_nonzero()) == 0
    assert key.data_ptr() != value.data_ptr()
    if _thp_mode() in ("always", "madvise"):
        assert _huge_kib_at(key.data_ptr()) >= 32 << 10, "the KV cache got no huge pages"
    # The tensor keeps its mapping alive: views outlive every other reference.
    rows = key.view(-1, 64)
    del key
    gc.collect()
    rows[-1].fill_(3.0)
    assert float(rows.sum()) == 3.0 * 64


def _resident_bytes(t) -> int:
    """Bytes of the tensor's mapping that are resident (mincore over its pages)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    page = mmap.PAGESIZE
    length = t.numel() * t.element_size()
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(length), vec) == 0
    return sum(b & 1 for b in vec) * page


def test_prefaulted_pages_are_resident_and_lazy_ones_only_once_written():
    import torch

    from raylm.runner.host_memory import huge_page_zeros

    size = 64 << 20
    eager = huge_page_zeros((size // 4,), torch.float32)
    lazy = huge_page_zeros((size // 4,), torch.float32, prefault=False)
    assert _resident_bytes(eager) == size
    assert _resident_bytes(lazy) < size // 8
    lazy[: (8 << 20) // 4] = 1.0
    assert (8 << 20) <= _resident_bytes(lazy) < size // 2
    # (Reading the rest maps the kernel's zero page there: checked last.)
    assert not eager.any() and lazy.sum().item() == (8 << 20) // 4
