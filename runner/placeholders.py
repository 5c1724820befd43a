"""The -1 placeholders async steps write into the host history, and their settling.

Under async scheduling an output the device sampled is ``-1`` in the host history until
its copy lands (docs/architecture.md §3 rule 6); these are the steps whose copies are
pending, settled without blocking each step and waited for only past a small backlog.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from raylm.runner.async_output import AsyncCopy
from raylm.runner.input_batch import CachedRequestState, InputBatch

# Past this many unsettled steps the oldest is waited for, so the backlog (and the tensors
# it keeps alive) stays bounded.
MAX_PENDING_STEPS = 4


@dataclass
class Placeholders:
    """The -1 placeholders one async step wrote."""

    states: list[CachedRequestState]
    positions: np.ndarray  # sequence position of each placeholder
    indices: np.ndarray  # row of each in the step's sampled tensor

    def kept(self, keep: np.ndarray) -> Placeholders:
        return Placeholders([s for s, k in zip(self.states, keep.tolist(), strict=True) if k],
                            self.positions[keep], self.indices[keep])


class OnHost(AsyncCopy):
    """Received ids already in host memory (CPU device): nothing to copy."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._array = tensor.numpy()

    def done(self) -> bool:
        return True

    def wait(self) -> list[np.ndarray]:
        return [self._array]


class PendingPlaceholders:
    """Steps whose sampled ids are still being copied, oldest first."""

    def __init__(self) -> None:
        self._pending: deque[tuple[AsyncCopy, Placeholders]] = deque()

    def add(self, copy: AsyncCopy, placeholders: Placeholders) -> None:
        self._pending.append((copy, placeholders))

    def settle(self, token_ids: np.ndarray, block: bool = True) -> None:
        """Write the real ids over the placeholders. ``block=False`` takes only copies
        that have landed (plus the oldest ones beyond the backlog bound)."""
        while self._pending:
            copy, ph = self._pending[0]
            if not (block or copy.done() or len(self._pending) > MAX_PENDING_STEPS):
                return
            sampled = copy.wait()[0]
            self._pending.popleft()
            tokens = sampled[ph.indices, 0].tolist()
            for state, pos, token in zip(ph.states, ph.positions.tolist(), tokens,
                                         strict=True):
                InputBatch.fill_placeholder(state, pos, token, token_ids)

    def clear(self) -> None:
        self._pending.clear()
