"""The LoRA side of one adapted linear: its device slots and its per-step product.

A ``LoRALinear`` is the ``lora`` hook of a parallel linear (``raylm.parallel.layers``):
the layer calls ``apply(x, out)`` on its local output, before a row-parallel layer's
all-reduce, so each TP rank adds its shard's share and the reduction sums them. Slots are
cut like the layer's weight: a column-parallel layer (q/k/v, gate/up) keeps A whole and
this rank's rows of B, a row-parallel one (o, down) this rank's columns of A and B whole;
the cuts go through the layer's own ``weight_loader``, so they follow its layout (KV
heads replicated over ranks included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from raylm.runner.lora import torch_ops
from raylm.runner.lora.mapping import LoRAMapping


@dataclass
class SliceLoRA:
    """One output slice's matrices on this rank: A [r, in], B [out, r] (scale folded)."""

    a: torch.Tensor
    b: torch.Tensor


class LoRAContext:
    """What every adapted linear of a model reads: the step's mapping and the kernels
    (``torch``, or ``triton`` on CUDA with the Triton attention backend)."""

    def __init__(self, backend: str) -> None:
        if backend not in ("torch", "triton"):
            raise ValueError(f"LoRA backend must be 'torch' or 'triton', got {backend!r}.")
        self.backend = backend
        self.mapping: LoRAMapping | None = None


def output_slices(base: torch.nn.Module) -> tuple[list[tuple[int, int]], list[object]]:
    """This rank's output slices of ``base`` as (first column, columns), and each slice's
    ``shard_id`` for the layer's weight loader."""
    if isinstance(base, QKVParallelLinear):
        q, kv = base.q_size, base.kv_size
        return [(0, q), (q, kv), (q + kv, kv)], ["q", "k", "v"]
    if isinstance(base, MergedColumnParallelLinear):
        sizes = base.output_sizes_per_partition
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return list(zip(starts, sizes, strict=True)), list(range(len(sizes)))
    if isinstance(base, RowParallelLinear):
        return [(0, base.output_size)], [None]
    raise TypeError(f"no LoRA for a {type(base).__name__}.")


class LoRALinear:
    """``num_slots`` adapters' A and B for one linear: A [slots, S * R, in] (slice s of a
    fused projection in rows s*R ..), B transposed [slots, R, out] (slice s in its own
    output columns). A slot of an adapter of rank r < R holds zeros past r."""

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, num_slots: int, rank: int,
                 context: LoRAContext) -> None:
        self.base = base
        self.context = context
        self.rank = rank
        self.slices, self.shard_ids = output_slices(base)
        weight = base.weight
        num_slices = len(self.slices)
        out_features = sum(size for _, size in self.slices)
        self.a = torch.zeros((num_slots, num_slices * rank, weight.shape[1]),
                             dtype=weight.dtype, device=weight.device)
        self.b = torch.zeros((num_slots, rank, out_features), dtype=weight.dtype,
                             device=weight.device)
        starts = [start for start, _ in self.slices] + [out_features]
        self.slice_starts = torch.tensor(starts, dtype=torch.int32, device=weight.device)
        self.widest_slice = max(size for _, size in self.slices)

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    @property
    def out_features(self) -> int:
        return int(self.b.shape[2])

    def shard(self, index: int, a: torch.Tensor, b: torch.Tensor) -> SliceLoRA:
        """This rank's part of slice ``index``'s whole A [r, in] and B [out, r], on the
        host in the layer's dtype."""
        dtype, r = self.base.weight.dtype, a.shape[0]
        if isinstance(self.base, RowParallelLinear):
            a_shard = torch.zeros((r, self.base.input_size_per_partition), dtype=dtype)
            self.base.weight_loader(a_shard, a)
            return SliceLoRA(a_shard, b.to(dtype))
        b_all = torch.zeros((self.base.weight.shape[0], r), dtype=dtype)
        self.base.weight_loader(b_all, b, self.shard_ids[index])
        start, size = self.slices[index]
        return SliceLoRA(a.to(dtype), b_all[start:start + size].clone())

    def write_slot(self, slot: int, parts: list[SliceLoRA | None] | None) -> None:
        """Put an adapter's slices (None: a slice it does not adapt) in ``slot``."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for s, part in enumerate(parts or ()):
            if part is None:
                continue
            r = part.a.shape[0]
            start, size = self.slices[s]
            self.a[slot, s * self.rank:s * self.rank + r].copy_(part.a, non_blocking=True)
            self.b[slot, :r, start:start + size].copy_(part.b.t(), non_blocking=True)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the step's LoRA products to ``out`` (this rank's output of ``x``)."""
        mapping = self.context.mapping
        if mapping is None or not mapping.active:
            return
        if mapping.buffers is not None:
            from raylm.runner.lora import triton_ops

            triton_ops.add_lora(out, x, self.a, self.b, self.slice_starts, self.widest_slice,
                                mapping.buffers, mapping.num_tokens)
        elif mapping.torch_segments is not None:
            torch_ops.add_lora(out, x, self.a, self.b, self.slices, mapping.torch_segments)
