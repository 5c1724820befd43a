"""Tensor-parallel collectives over ``ctx.tp_group`` (no-ops when tp_size == 1)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from raylm.parallel.context import ParallelContext


def tp_all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place; returns ``x``."""
    if ctx.tp_size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=ctx.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, ctx: ParallelContext, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along ``dim`` (rank order)."""
    if ctx.tp_size == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    # all_gather_into_tensor stacks along dim 0; gather there, then move the rank axis.
    out = torch.empty((ctx.tp_size, *x.shape), dtype=x.dtype, device=x.device)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x, group=ctx.tp_group)
    else:
        # gloo has no all_gather_into_tensor; the list form writes into views of ``out``.
        dist.all_gather(list(out.unbind(0)), x, group=ctx.tp_group)
    out = out.movedim(0, dim)  # [..., tp, x.shape[dim], ...]
    return out.reshape(*x.shape[:dim], ctx.tp_size * x.shape[dim], *x.shape[dim + 1:])
