"""Keep freed host memory mapped in CPU worker processes.

glibc returns large freed blocks to the kernel (those above its adaptive mmap threshold)
and trims the top of the heap; the next step's tensors of a similar size then fault every
page in again. A CPU step allocates megabytes of activations, logits and gathered KV
whose sizes change from step to step, so a mixed workload takes tens of thousands of
minor faults per run (README, offline throughput). Raising both
thresholds keeps those pages for reuse, the effect vLLM's CPU backend gets from preloading
tcmalloc. The setting is process-wide and trades a peak-sized heap for it; an engine's
worker process wants that, and ``RAYLM_CPU_KEEP_FREED_MEMORY=0`` leaves glibc alone.
"""

from __future__ import annotations

import ctypes
import logging

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
