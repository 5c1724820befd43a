"""A Mamba2 mixer layer over the flattened mixed batch, its state in per-request slots.

in_proj gives, per token, the gate z, the convolution's input (x, B, C) and dt. Each
prefill or chunk span convolves and scans from its slot's state (zeros when it starts the
request) and leaves its final state in the request's first slot; decodes and verification
steps run together through the recurrence, leaving the state after each token in a slot
of its own (runner/state_cache.py). Then the gated RMS norm (per group) and out_proj. Checkpoint names and
layouts are transformers' (BambaMixer, GraniteMoeHybridMambaLayer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    Weight,
    new_param,
    read_whole,
    set_weight_loader,
)
from raylm.runner.models.recurrent_mixer import PerToken, RecurrentMixer
from raylm.runner.models.ssd import ssd_chunked, ssd_decode
from raylm.runner.state_cache import StateMetadata
from raylm.scheduler.config.mamba2_shape import Mamba2Shape


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, shape: Mamba2Shape, hidden_size: int, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__(ctx)
        self.full = shape
        self.shape = s = shape.per_rank(ctx.tp_size)
        gn = shape.n_groups * shape.d_state
        # Checkpoint order: z, x, B, C, dt.
        self.in_proj = MergedColumnParallelLinear(
            hidden_size, [shape.intermediate_size, shape.intermediate_size, gn, gn,
                          shape.num_heads], False, ctx=ctx, params_dtype=dtype)
        self.conv_weight = new_param((s.conv_dim, shape.d_conv), ctx, dtype)
        self.conv_bias = new_param((s.conv_dim,), ctx, dtype) if shape.conv_bias else None
        self.dt_bias = new_param((s.num_heads,), ctx, dtype)
        self.A_log = new_param((s.num_heads,), ctx, dtype)
        self.D = new_param((s.num_heads,), ctx, dtype)
        # Falcon-H1 without mamba_rms_norm gates the output without a norm.
        self.norm_weight = (new_param((s.intermediate_size,), ctx, dtype)
                            if shape.gated_norm != "none" else None)
        self.out_proj = RowParallelLinear(shape.intermediate_size, hidden_size, False,
                                          ctx=ctx, params_dtype=dtype)
        for param in (self.conv_weight, self.conv_bias, self.dt_bias, self.A_log, self.D,
                      self.norm_weight):
            if param is not None:
                set_weight_loader(param, self._load_sharded)

    # ------------------------------------------------------------------ loading
    def _load_sharded(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        """Per-head and per-channel parameters: this rank's heads, and for the convolution
        its share of each of x, B and C."""
        full = read_whole(loaded_weight)
        if full.dim() == 3:  # conv1d.weight [conv_dim, 1, K]
            full = full[:, 0]
        tp, rank = self.ctx.tp_size, self.ctx.tp_rank
        if param.shape[0] == self.shape.conv_dim and full.shape[0] == self.full.conv_dim:
            gn = self.full.n_groups * self.full.d_state
            parts = full.split([self.full.intermediate_size, gn, gn])
            full = torch.cat([p.chunk(tp)[rank] for p in parts])
        else:
            full = full.chunk(tp)[rank]
        if full.shape != param.shape:
            raise ValueError(f"Mamba2 parameter of shape {tuple(full.shape)} does not fit "
                             f"{tuple(param.shape)}.")
        param.data.copy_(full)

    def load_in_proj(self, loaded: Weight) -> None:
        """The fused checkpoint projection [z, x, B, C, dt] into its five shards."""
        offset = 0
        for i, size in enumerate(self.in_proj.output_sizes):
            self.in_proj.weight_loader(self.in_proj.weight, loaded.narrow(0, offset, size), i)
            offset += size

    # ------------------------------------------------------------------ forward
    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.shape.num_heads, self.shape.head_dim, self.shape.d_state)

    def forward(self, hidden_states: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        s = self.shape
        if s.in_multiplier != 1.0:  # Falcon-H1's muP
            hidden_states = hidden_states * s.in_multiplier
        z, x, B, C, dt = self.in_proj(hidden_states).split(
            self.in_proj.output_sizes_per_partition, dim=-1)
        if s.zxbcdt_multipliers != (1.0,) * 5:
            z, x, B, C, dt = (t * m for t, m in zip((z, x, B, C, dt), s.zxbcdt_multipliers,
                                                     strict=True))
        y = hidden_states.new_empty(hidden_states.shape[0], s.num_heads, s.head_dim,
                                    dtype=torch.float32)
        self.run_rows(meta, torch.cat([x, B, C], dim=-1), (dt,), y)
        out = self._gated_norm(y.reshape(y.shape[0], -1), z)
        return self.out_proj(out.to(hidden_states.dtype))

    def scan_span(self, conv_out: torch.Tensor, per_token: PerToken,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        x, B, C = self._xbc(conv_out)
        return ssd_chunked(x, per_token[0], self._A(), B, C, self.D, self.dt_bias,
                           self.shape.chunk_size, state, self.shape.time_step_limit)

    def scan_step(self, conv_out: torch.Tensor, per_token: PerToken,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, B, C = self._xbc(conv_out)
        return ssd_decode(x, per_token[0], self._A(), B, C, self.D, self.dt_bias, state)

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def _xbc(self, conv_out: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        gn = s.n_groups * s.d_state
        x, B, C = conv_out.split([s.intermediate_size, gn, gn], dim=-1)
        rows = conv_out.shape[0]
        return (x.reshape(rows, s.num_heads, s.head_dim),
                B.reshape(rows, s.n_groups, s.d_state), C.reshape(rows, s.n_groups, s.d_state))

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """transformers' gated RMS norm, per group: y * silu(z) normalised and scaled
        (Bamba, Granite); or normalised, scaled, then gated (Falcon-H1's
        mamba_norm_before_gate); or gated alone (Falcon-H1 without mamba_rms_norm)."""
        s = self.shape
        h = y.float()
        silu = F.silu(gate.float())
        if self.norm_weight is None:
            return h * silu
        if s.gated_norm == "gate_first":
            h = h * silu
        grouped = h.reshape(h.shape[0], s.n_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + s.norm_eps)
        if s.gated_norm == "gate_first":
            return self.norm_weight * grouped.reshape(h.shape).to(self.norm_weight.dtype)
        return self.norm_weight * grouped.reshape(h.shape) * silu
