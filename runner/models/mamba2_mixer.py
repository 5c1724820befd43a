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
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    Weight,
    new_param,
    read_whole,
    set_weight_loader,
)
from raylm.runner.models.ssd import (
    causal_conv_decode,
    causal_conv_span,
    ssd_chunked,
    ssd_decode,
)
from raylm.runner.state_cache import RecurrentRows, StateMetadata
from raylm.scheduler.config.mamba2_shape import Mamba2Shape


class Mamba2Mixer(nn.Module):
    def __init__(self, shape: Mamba2Shape, hidden_size: int, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.full = shape
        self.shape = s = shape.per_rank(ctx.tp_size)
        self.ctx = ctx
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
        self.norm_weight = new_param((s.intermediate_size,), ctx, dtype)
        self.out_proj = RowParallelLinear(shape.intermediate_size, hidden_size, False,
                                          ctx=ctx, params_dtype=dtype)
        for param in (self.conv_weight, self.conv_bias, self.dt_bias, self.A_log, self.D,
                      self.norm_weight):
            if param is not None:
                set_weight_loader(param, self._load_sharded)
        # Bound by the runner (initialize_state_cache): [slots, conv_dim, d_conv - 1] in
        # the model dtype and [slots, heads, head_dim, d_state] float32.
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

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

    def allocate_state(self, num_slots: int) -> None:
        s = self.shape
        self.conv_state = torch.zeros(num_slots, s.conv_dim, s.d_conv - 1,
                                      dtype=self.conv_weight.dtype, device=self.ctx.device)
        self.ssm_state = torch.zeros(num_slots, s.num_heads, s.head_dim, s.d_state,
                                     dtype=torch.float32, device=self.ctx.device)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("the Mamba2 state cache is not allocated "
                               "(initialize_kv_cache first).")
        s = self.shape
        gate, xbc, dt = self._split(self.in_proj(hidden_states))
        A = -torch.exp(self.A_log.float())
        y = hidden_states.new_empty(hidden_states.shape[0], s.num_heads, s.head_dim,
                                    dtype=torch.float32)
        for span in meta.spans:
            rows = slice(span.start, span.end)
            fresh = span.read_slot < 0
            conv_in = None if fresh else self.conv_state[span.read_slot]
            conv_out, history = causal_conv_span(xbc[rows], conv_in, self.conv_weight,
                                                 self.conv_bias)
            self.conv_state[span.write_slot] = history
            x, B, C = self._xbc(conv_out)
            state = None if fresh else self.ssm_state[span.read_slot]
            y[rows], final = ssd_chunked(x, dt[rows], A, B, C, self.D, self.dt_bias,
                                         s.chunk_size, state, s.time_step_limit)
            self.ssm_state[span.write_slot] = final
        if meta.recurrent is not None:
            self._recurrent(meta.recurrent, xbc, dt, A, y)
        out = self._gated_norm(y.reshape(y.shape[0], -1), gate)
        return self.out_proj(out.to(hidden_states.dtype))

    def _recurrent(self, rows: RecurrentRows, xbc: torch.Tensor, dt: torch.Tensor,
                   A: torch.Tensor, y: torch.Tensor) -> None:
        """Rows that continue their state, one token offset at a time: the state after
        each token stays in its own slot (a verification step's next step reads the one
        after its last accepted token)."""
        assert self.conv_state is not None and self.ssm_state is not None  # forward checks
        history = self.conv_state.index_select(0, rows.read_slots)
        state = self.ssm_state.index_select(0, rows.read_slots)
        for tokens, slots in zip(rows.tokens, rows.write_slots, strict=True):
            n = tokens.shape[0]  # the longest rows come first
            conv_out, history_n = causal_conv_decode(xbc[tokens], history[:n],
                                                     self.conv_weight, self.conv_bias)
            x, B, C = self._xbc(conv_out)
            y[tokens], state_n = ssd_decode(x, dt[tokens], A, B, C, self.D, self.dt_bias,
                                            state[:n])
            history, state = history_n, state_n
            self.conv_state[slots] = history
            self.ssm_state[slots] = state

    def _split(self, projected: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z, x, B, C, dt = projected.split(self.in_proj.output_sizes_per_partition, dim=-1)
        return z, torch.cat([x, B, C], dim=-1), dt

    def _xbc(self, conv_out: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        gn = s.n_groups * s.d_state
        x, B, C = conv_out.split([s.intermediate_size, gn, gn], dim=-1)
        rows = conv_out.shape[0]
        return (x.reshape(rows, s.num_heads, s.head_dim),
                B.reshape(rows, s.n_groups, s.d_state), C.reshape(rows, s.n_groups, s.d_state))

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """transformers' gated RMS norm: y * silu(z), normalised per group, scaled."""
        s = self.shape
        h = y.float() * F.silu(gate.float())
        grouped = h.reshape(h.shape[0], s.n_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + s.norm_eps)
        return self.norm_weight * grouped.reshape(h.shape).to(self.norm_weight.dtype)
