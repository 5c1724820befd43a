"""The LoRA products in torch (CPU, and CUDA without Triton), per segment of tokens that
share an adapter (``mapping.TorchSegments``).

Slots hold A as [num_slots, S * R, in] (slice s of a fused projection such as q/k/v in
rows s*R ..) and B transposed as [num_slots, R, out], the scale folded in: one shrink
``x A^T`` per segment gives every slice's rank columns at once, then each slice's expand
``h_s B_s`` its own output columns. ``out`` is the base layer's output (before a
row-parallel all-reduce), added to in place.
"""

from __future__ import annotations

import torch

from raylm.runner.lora.mapping import TorchSegments


def _expand(h: torch.Tensor, b: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
    """h [..., S * R] times each slice's B [.., R, size]: the [..., out] product."""
    rank = b.shape[-2]
    matmul = torch.bmm if h.dim() == 3 else torch.mm
    parts = [matmul(h[..., s * rank:(s + 1) * rank], b[..., start:start + size])
             for s, (start, size) in enumerate(slices)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slices: list[tuple[int, int]], seg: TorchSegments) -> None:
    """out[t] += (x[t] A[slot(t)]^T) B[slot(t)] for every token with an adapter."""
    if seg.loop is not None:
        for slot, rows in seg.loop:
            delta = _expand(torch.mm(x[rows], a[slot].t()), b[slot], slices)
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return
    assert seg.slots is not None and seg.gather is not None and seg.tokens is not None
    g, m = seg.shape
    if isinstance(seg.slots, slice):  # consecutive slots: the weights in place
        a, b = a[seg.slots], b[seg.slots]
    else:
        a, b = a.index_select(0, seg.slots), b.index_select(0, seg.slots)
    xs = x.index_select(0, seg.gather).view(g, m, x.shape[1])
    delta = _expand(torch.bmm(xs, a.transpose(1, 2)), b, slices).view(g * m, -1)
    if seg.valid is not None:
        delta = delta.index_select(0, seg.valid)
    out.index_add_(0, seg.tokens, delta)
