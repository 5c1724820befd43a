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


def steady_generate_reads(llm, batch: list[dict], params) -> tuple[list, Counter]:
    """Warm ``llm`` up on ``batch``, then generate it again counting host reads: the
    outputs and the reads (the input preparer's three host staging buffers excluded)."""
    llm.generate(batch, params, use_tqdm=False)  # warm-up
    preparer = llm.llm_engine.core.engine_core.executor.worker.model_runner.input_preparer
    buffers = [v for k, v in vars(preparer).items() if k.endswith("_cpu")]
    assert len(buffers) == 3, list(vars(preparer))
    with host_reads(buffers) as reads:
        outs = llm.generate(batch, params, use_tqdm=False)
    return outs, reads


def assert_only_the_copier_reads(reads: Counter) -> None:
    """The copier's own reads are the only ones (and there were some: the check is live)."""
    assert any(f == COPIER for f, _, _ in reads), reads
    others = {k: n for k, n in reads.items() if k[0] != COPIER}
    assert not others, f"host reads of device tensors outside the copier: {others}"
