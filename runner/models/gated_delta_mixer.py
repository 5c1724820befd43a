"""Qwen3-Next's gated delta net layer over the flattened mixed batch, its convolution
history and state in the request's slots (the driver: runner/models/recurrent_mixer.py).

in_proj_qkvz gives, per key head, its query and key and the values and output gates of
the value heads it serves; in_proj_ba the update strength (beta = sigmoid(b)) and the
decay (g = -exp(A_log) softplus(a + dt_bias)) per value head. q, k and v go through the
causal convolution (SiLU), then the gated delta rule (runner/models/gated_delta.py); each
value head's output is RMS-normalised, scaled, gated by SiLU(z) and projected out.
Checkpoint names and layouts are transformers' (Qwen3NextGatedDeltaNet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Weight,
    new_param,
    read_whole,
    replicated_weight_loader,
    set_weight_loader,
)
from raylm.runner.models.gated_delta import gated_delta_chunked, gated_delta_step
from raylm.runner.models.recurrent_mixer import PerToken, RecurrentMixer
from raylm.runner.state_cache import StateMetadata
from raylm.scheduler.config.gdn_shape import GatedDeltaShape


class GatedDeltaNetMixer(RecurrentMixer):
    def __init__(self, shape: GatedDeltaShape, hidden_size: int, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__(ctx)
        self.full = shape
        self.shape = s = shape.per_rank(ctx.tp_size)
        self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * shape.key_dim
                                                 + 2 * shape.value_dim, False, ctx=ctx,
                                                 params_dtype=dtype)
        self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * shape.num_v_heads, False,
                                               ctx=ctx, params_dtype=dtype)
        self.conv_weight = new_param((s.conv_dim, shape.conv_kernel), ctx, dtype)
        self.conv_bias = None
        self.dt_bias = new_param((s.num_v_heads,), ctx, dtype)
        self.A_log = new_param((s.num_v_heads,), ctx, dtype)
        self.norm_weight = new_param((s.head_v_dim,), ctx, dtype)
        self.out_proj = RowParallelLinear(shape.value_dim, hidden_size, False, ctx=ctx,
                                          params_dtype=dtype)
        for param in (self.conv_weight, self.dt_bias, self.A_log):
            set_weight_loader(param, self._load_sharded)
        set_weight_loader(self.norm_weight, replicated_weight_loader)

    def _load_sharded(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        """Per-value-head parameters: this rank's heads; the convolution: its share of
        each of q, k and v."""
        full = read_whole(loaded_weight)
        tp, rank = self.ctx.tp_size, self.ctx.tp_rank
        if full.dim() == 3:  # conv1d.weight [conv_dim, 1, K]
            f = self.full
            parts = full[:, 0].split([f.key_dim, f.key_dim, f.value_dim])
            full = torch.cat([p.chunk(tp)[rank] for p in parts])
        else:
            full = full.chunk(tp)[rank]
        if full.shape != param.shape:
            raise ValueError(f"gated delta net parameter of shape {tuple(full.shape)} does "
                             f"not fit {tuple(param.shape)}.")
        param.data.copy_(full)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.shape.num_v_heads, self.shape.head_k_dim, self.shape.head_v_dim)

    def forward(self, hidden_states: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        s = self.shape
        tokens = hidden_states.shape[0]
        per_k = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(hidden_states).reshape(
            tokens, s.num_k_heads, 2 * s.head_k_dim + 2 * per_k * s.head_v_dim)
        q, k, v, z = qkvz.split([s.head_k_dim, s.head_k_dim, per_k * s.head_v_dim,
                                 per_k * s.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(hidden_states).reshape(tokens, s.num_k_heads, 2 * per_k).split(
            [per_k, per_k], dim=-1)
        beta = b.reshape(tokens, s.num_v_heads).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(tokens, s.num_v_heads).float()
                                                   + self.dt_bias)
        conv_in = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1),
                             v.reshape(tokens, -1)], dim=-1)
        out = hidden_states.new_empty(tokens, s.num_v_heads, s.head_v_dim,
                                      dtype=torch.float32)
        self.run_rows(meta, conv_in, (g, beta), out)
        out = self._gated_norm(out.to(hidden_states.dtype),
                               z.reshape(tokens, s.num_v_heads, s.head_v_dim))
        return self.out_proj(out.reshape(tokens, -1))

    def _qkv(self, conv_out: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        rows = conv_out.shape[0]
        q, k, v = conv_out.split([s.num_k_heads * s.head_k_dim, s.num_k_heads * s.head_k_dim,
                                  s.num_v_heads * s.head_v_dim], dim=-1)
        return (q.reshape(rows, s.num_k_heads, s.head_k_dim),
                k.reshape(rows, s.num_k_heads, s.head_k_dim),
                v.reshape(rows, s.num_v_heads, s.head_v_dim))

    def scan_span(self, conv_out: torch.Tensor, per_token: PerToken,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        g, beta = per_token
        return gated_delta_chunked(*self._qkv(conv_out), g, beta, self.shape.chunk_size,
                                   state)

    def scan_step(self, conv_out: torch.Tensor, per_token: PerToken,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, beta = per_token
        return gated_delta_step(*self._qkv(conv_out), g, beta, state)

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """transformers' Qwen3NextRMSNormGated: per value head, normalise, scale, then
        gate by SiLU(z)."""
        h = out.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.shape.norm_eps)
        h = self.norm_weight * h.to(out.dtype)
        return (h * F.silu(z.float())).to(out.dtype)
