"""One step's LoRA mapping: which device slot each token's adapter is in, grouped.

Every adapted linear of the step reads the same mapping (``LoRAContext.mapping``). The
tokens of one adapter form a segment of a sorted order; the products run once per segment
(one shrink and one expand per projection), never once per request:

- torch (CPU, and CUDA without Triton): a step of several adapters whose segments are
  about as long as each other runs them as one batched matmul over the segments padded to
  the longest (``bmm``); otherwise one matmul pair per segment (``loop``), a segment that
  is a contiguous range of tokens taken as a slice.
- Triton (CUDA): the sorted token order and each segment's slot, start and length in
  buffers at fixed addresses (``TritonBuffers``), which the kernels read on the device. A
  decode step replayed as a CUDA graph finds its slots there, padding rows in no segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.runner.prepare_inputs import upload

NO_SLOT = -1
# bmm pads every segment to the longest: taken while that costs at most this many times
# the tokens (else one matmul pair per segment, no padding).
_MAX_PADDING_RATIO = 2


@dataclass
class TorchSegments:
    """The torch kernels' view of a step: ``loop`` holds (slot, rows) per segment (rows a
    slice or an index tensor); ``bmm`` the padded layout: ``slots`` [G] (a slice when the
    segments' slots are consecutive: the weights are then read in place), ``gather``
    [G * M] (each padded position's token), ``valid`` [N] (positions of real tokens in
    the padded order, None when no segment is padded) and ``tokens`` [N]."""

    loop: list[tuple[int, slice | torch.Tensor]] | None = None
    slots: slice | torch.Tensor | None = None
    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    shape: tuple[int, int] = (0, 0)


@dataclass
class LoRAMapping:
    """``num_tokens``: the step's tokens (padding rows included); ``active``: whether any
    kernel must run (a CUDA graph's step always runs them: its slots are read on the
    device)."""

    num_tokens: int
    active: bool
    torch_segments: TorchSegments | None = None
    buffers: TritonBuffers | None = None


def segments(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                np.ndarray]:
    """The tokens with an adapter sorted by slot (stable), and each segment's slot, start
    in that order and length."""
    tokens = np.flatnonzero(token_slots != NO_SLOT)
    order = tokens[np.argsort(token_slots[tokens], kind="stable")]
    slots, starts, counts = np.unique(token_slots[order], return_index=True,
                                      return_counts=True)
    return order, slots, starts, counts


def torch_segments(token_slots: np.ndarray, device: torch.device) -> TorchSegments | None:
    """The torch kernels' plan for a step; None when no token has an adapter."""
    order, slots, starts, counts = segments(token_slots)
    if order.size == 0:
        return None
    g, m, n = slots.size, int(counts.max()), order.size
    if g == 1 or g * m > _MAX_PADDING_RATIO * n:
        loop: list[tuple[int, slice | torch.Tensor]] = []
        for slot, start, count in zip(slots.tolist(), starts.tolist(), counts.tolist(),
                                      strict=True):
            rows = order[start:start + count]
            if rows[-1] - rows[0] + 1 == count:  # contiguous (one request, or neighbours)
                loop.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                loop.append((slot, upload(rows, device)))
        return TorchSegments(loop=loop)
    position = np.arange(n) - np.repeat(starts, counts)  # within its segment
    padded = np.repeat(np.arange(g), counts) * m + position
    gather = np.repeat(order[starts], m)  # pads repeat their segment's first token
    gather[padded] = order
    consecutive = int(slots[-1]) - int(slots[0]) + 1 == g
    return TorchSegments(slots=slice(int(slots[0]), int(slots[-1]) + 1) if consecutive
                         else upload(slots, device), gather=upload(gather, device),
                         valid=None if g * m == n else upload(padded, device),
                         tokens=upload(order, device), shape=(g, m))


class TritonBuffers:
    """The Triton kernels' metadata at fixed device addresses: ``sorted_tokens``
    [capacity] (tokens grouped by segment), ``seg_slot`` / ``seg_start`` / ``seg_len``
    [num_slots] (slot -1: an unused segment). A CUDA graph replays over them."""

    def __init__(self, capacity: int, num_slots: int, device: torch.device) -> None:
        self.capacity = capacity
        self.num_slots = num_slots
        self.sorted_tokens = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.seg = torch.full((3, num_slots), NO_SLOT, dtype=torch.int32, device=device)
        self.seg[1:] = 0
        self.device = device

    @property
    def seg_slot(self) -> torch.Tensor:
        return self.seg[0]

    @property
    def seg_start(self) -> torch.Tensor:
        return self.seg[1]

    @property
    def seg_len(self) -> torch.Tensor:
        return self.seg[2]

    def fill(self, token_slots: np.ndarray) -> bool:
        """Write a step's segments in; whether any token has an adapter."""
        if token_slots.size > self.capacity:
            raise ValueError(f"a step of {token_slots.size} tokens exceeds the LoRA "
                             f"buffers' {self.capacity}.")
        order, slots, starts, counts = segments(token_slots)
        if slots.size > self.num_slots:
            raise RuntimeError(f"a step uses {slots.size} LoRA slots of {self.num_slots}.")
        seg = np.zeros((3, self.num_slots), np.int32)
        seg[0] = NO_SLOT
        seg[0, :slots.size], seg[1, :slots.size], seg[2, :slots.size] = slots, starts, counts
        self.seg.copy_(upload(seg, self.device), non_blocking=True)
        if order.size:
            self.sorted_tokens[:order.size].copy_(
                upload(order.astype(np.int32), self.device), non_blocking=True)
        return bool(order.size)
