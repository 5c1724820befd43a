"""How CPU workers hold host memory: freed memory stays mapped, the KV cache in huge pages.

A CPU step's tensors change size from step to step, and glibc returns large freed blocks
to the kernel, so the next step faults their pages in again. Raising glibc's mmap and trim
thresholds keeps them (what vLLM's CPU backend gets from tcmalloc), process-wide, for a
peak-sized heap; ``RAYLM_CPU_KEEP_FREED_MEMORY=0`` leaves glibc alone. The KV cache is
allocated apart from the heap (``huge_page_zeros``).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit; larger blocks stay mmapped
_TRIM_THRESHOLD = 1 << 30  # free heap top kept up to 1 GiB


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


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor in a private anonymous mapping advised for transparent huge
    pages (Linux).

    For the CPU KV cache: a step reads every row's blocks from scattered places in a pool
    of hundreds of MiB, so with 4 KiB pages nearly every block costs a TLB miss, which
    2 MiB pages avoid (bench/attention.py measures it). The kernel's THP
    setting "madvise", the common default, gives huge pages only to memory that asks,
    and the heap cannot ask reliably: its pages may already be faulted in as 4 KiB ones.
    Without THP the advice is refused and the mapping works as plain memory."""
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
    return tensor.zero_()
