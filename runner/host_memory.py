"""How CPU workers hold host memory: freed memory stays mapped, the KV cache in huge pages.

A CPU step's tensors change size from step to step, and glibc returns large freed blocks
to the kernel, so the next step faults their pages in again. Raising glibc's mmap and trim
thresholds keeps them (what vLLM's CPU backend gets from tcmalloc), process-wide, for a
peak-sized heap; ``RAYLM_CPU_KEEP_FREED_MEMORY=0`` leaves glibc alone. The KV cache is
allocated apart from the heap (``huge_page_zeros``). oneDNN's primitive caches, which
would grow with every new step size, are capped (``cap_onednn_primitive_caches``).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os

import torch

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit; larger blocks stay mmapped
_TRIM_THRESHOLD = 1 << 30  # free heap top kept up to 1 GiB
# Primitives kept per oneDNN cache (oneDNN's own and ideep's; 1024 each by default).
ONEDNN_CACHE_CAPACITY = 128
_ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def keep_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where there is no glibc to tune."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS, ...: their allocators differ
        return False
    ok = (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
          and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1)
    if not ok:
        logger.info("mallopt refused the host memory thresholds; glibc defaults stay.")
    return ok


def cap_onednn_primitive_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """The packed CPU linears (parallel/layers.py) run oneDNN primitives that oneDNN and
    ideep cache per shape, 1024 of each by default; every new step size is a new shape and
    each entry holds ~1 MB of heap, so a worker whose step sizes keep varying grew by
    hundreds of MB over a 30-minute soak (bench/worker_memory.py: capped, the heap stays
    flat at the same speed). Set before this process's first primitive (both are read
    then); a value already in the environment wins."""
    for var in _ONEDNN_CACHE_VARS:
        os.environ.setdefault(var, str(capacity))


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype,
                    prefault: bool = True) -> torch.Tensor:
    """A zeroed host tensor in a private anonymous mapping advised for transparent huge
    pages (Linux).

    For the CPU KV cache: a step reads every row's blocks from scattered places in a pool
    of hundreds of MiB, so with 4 KiB pages nearly every block costs a TLB miss, which
    2 MiB pages avoid (bench/attention.py measures it). The kernel's THP
    setting "madvise", the common default, gives huge pages only to memory that asks,
    and the heap cannot ask reliably: its pages may already be faulted in as 4 KiB ones.
    Without THP the advice is refused and the mapping works as plain memory.
    ``prefault``: touch every page now (the memory is known to be there and the first
    steps do not pay the faults); else the kernel zero-fills each page on its first write."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:  # a kernel built without transparent huge pages
            pass
    # The tensor holds a reference to the mapping: it is unmapped when the tensor dies.
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
    # Fault every page in now, at startup, not during the first steps that write there.
    return tensor.zero_() if prefault else tensor
