"""The CPU KV cache's host memory: zeros either way; prefaulted pages are resident at
once, the others only once written."""

from __future__ import annotations

import torch

from raylm.runner.host_memory import huge_page_zeros

SIZE = 64 << 20


def _resident_bytes(t: torch.Tensor) -> int:
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
    eager = huge_page_zeros((SIZE // 4,), torch.float32)
    lazy = huge_page_zeros((SIZE // 4,), torch.float32, prefault=False)
    assert _resident_bytes(eager) == SIZE
    assert _resident_bytes(lazy) < SIZE // 8
    lazy[: (8 << 20) // 4] = 1.0
    assert (8 << 20) <= _resident_bytes(lazy) < SIZE // 2
    # (Reading the rest maps the kernel's zero page there: checked last.)
    assert not eager.any() and lazy.sum().item() == (8 << 20) // 4
