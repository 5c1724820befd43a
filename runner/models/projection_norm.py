"""OLMoE's q/k norm: one RMSNorm over the whole q (or k) projection of a token, all heads
together, before the heads are split (transformers' OlmoeAttention), where Qwen3 normalises
each head alone.

With tensor parallelism a rank holds only its heads' columns, so the mean square is summed
over the TP group: every rank holds the same number of columns (KV heads replicated evenly
when there are fewer than ranks), so the sum over ranks divided by their total count is the
mean over the whole projection, each replica counted as often as the others.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.parallel.communication import tp_all_reduce
from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import Weight, new_param, read_whole, set_weight_loader


class ProjectionRMSNorm(nn.Module):
    """``weight`` is this rank's slice: ``size`` columns starting at ``shard * size`` of the
    checkpoint's whole norm."""

    def __init__(self, size: int, shard: int, eps: float, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx, self.size, self.shard, self.eps = ctx, size, shard, eps
        self.weight = new_param((size,), ctx, dtype)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        shard = loaded_weight.narrow(0, self.shard * self.size, self.size)
        param.data.copy_(read_whole(shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [T, size], this rank's columns of the projection."""
        h = x.float()
        square_sum = h.pow(2).sum(-1, keepdim=True)
        variance = tp_all_reduce(square_sum, self.ctx) / (self.size * self.ctx.tp_size)
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(x.dtype)
