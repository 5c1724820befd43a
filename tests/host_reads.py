"""Who reads device tensors' values on the host (tests/runner/test_host_reads.py explains
the rule): the copier alone, in steady async steps."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import raylm.runner

# The repository root (raylm's subpackages are its folders): callers are named from it.
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(raylm.runner.__file__)))
COPIER = os.path.join("runner", "async_output.py")
METHODS = ("cpu", "numpy", "tolist", "item")


@contextmanager
def host_reads(host_buffers: list[torch.Tensor]) -> Iterator[Counter]:
    """Counts, by raylm file and function, the calls of ``METHODS`` on any torch tensor
    but ``host_buffers`` (and their views) inside the block (every thread)."""
    reads: Counter = Counter()
    host = {t.untyped_storage().data_ptr() for t in host_buffers}
    originals = {m: getattr(torch.Tensor, m) for m in METHODS}

    def wrap(name):
        original = originals[name]

        def recorded(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if (caller.co_filename.startswith(PACKAGE)
                    and self.untyped_storage().data_ptr() not in host):
                reads[(os.path.relpath(caller.co_filename, PACKAGE), caller.co_name, name)] += 1
            return original(self, *args, **kwargs)
        return recorded

    for m in METHODS:
        setattr(torch.Tensor, m, wrap(m))
    try:
        yield reads
    finally:
        for m, original in originals.items():
            setattr(torch.Tensor, m, original)
