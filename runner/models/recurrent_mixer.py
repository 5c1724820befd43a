"""What every recurrent token mixer (Mamba2, gated delta net) shares: a depthwise causal
convolution and a recurrent state per request, both kept in the request's state slots
(runner/state_cache.py), and the one step that runs each row from the slot its state is in.

A subclass gives the convolution's channels and weights, its state's shape, and the scan
in two forms: over a span (a prefill or a chunk of one, from a state or from zeros, the
final state returned) and one token for a batch of rows (decodes and verification steps,
one token offset at a time). The driver reads and writes the slots; the state after each
token of a short row goes to a slot of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.runner.models.ssd import causal_conv_decode, causal_conv_span
from raylm.runner.state_cache import RecurrentRows, StateMetadata

# Per-token inputs of the scan besides the convolution's output (dt for Mamba2; beta and
# the decay for the gated delta net), each [T, ...], sliced per span or per rows.
PerToken = tuple[torch.Tensor, ...]


class RecurrentMixer(nn.Module):
    conv_weight: nn.Parameter  # [conv_dim, d_conv]
    conv_bias: nn.Parameter | None

    def __init__(self, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        # Bound by the runner (allocate_state): [slots, conv_dim, d_conv - 1] in the
        # model dtype, and [slots, *state_shape] float32.
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    # ------------------------------------------------------------------ subclass hooks
    @property
    def state_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def scan_span(self, conv_out: torch.Tensor, per_token: PerToken,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One span: (outputs [L, ...] float32, final state)."""
        raise NotImplementedError

    def scan_step(self, conv_out: torch.Tensor, per_token: PerToken,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each of n rows: (outputs [n, ...] float32, new states [n, ...])."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the driver
    def state_bytes(self) -> int:
        """One slot of this layer (this rank's share)."""
        conv = self.conv_weight.shape[0] * (self.conv_weight.shape[1] - 1)
        state = 1
        for n in self.state_shape:
            state *= n
        return conv * self.conv_weight.element_size() + state * 4

    def allocate_state(self, num_slots: int) -> None:
        channels, kernel = self.conv_weight.shape
        self.conv_state = torch.zeros(num_slots, channels, kernel - 1,
                                      dtype=self.conv_weight.dtype, device=self.ctx.device)
        self.ssm_state = torch.zeros(num_slots, *self.state_shape, dtype=torch.float32,
                                     device=self.ctx.device)

    def run_rows(self, meta: StateMetadata, conv_in: torch.Tensor, per_token: PerToken,
                 out: torch.Tensor) -> None:
        """Every row of the step: ``conv_in`` [T, conv_dim] the convolution's input,
        ``out`` [T, ...] float32 filled with the scan's outputs."""
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("the recurrent state cache is not allocated "
                               "(initialize_kv_cache first).")
        for span in meta.spans:
            fresh = span.read_slot < 0
            history = None if fresh else self.conv_state[span.read_slot]
            state = None if fresh else self.ssm_state[span.read_slot]
            start = span.start
            # Pieces of the span: up to each cut (a snapshot of the state there), then the
            # rest; each continues the one before.
            for end, slot in (*span.cuts, (span.end, span.write_slot)):
                rows = slice(start, end)
                conv_out, history = causal_conv_span(conv_in[rows], history,
                                                     self.conv_weight, self.conv_bias)
                self.conv_state[slot] = history
                out[rows], state = self.scan_span(conv_out, tuple(t[rows] for t in per_token),
                                                  state)
                self.ssm_state[slot] = state
                start = end
        if meta.recurrent is not None:
            self._run_recurrent(meta.recurrent, conv_in, per_token, out)
        if meta.saves is not None:  # prefix caching: states at block boundaries
            src, dst = meta.saves
            self.conv_state.index_copy_(0, dst, self.conv_state.index_select(0, src))
            self.ssm_state.index_copy_(0, dst, self.ssm_state.index_select(0, src))

    def _run_recurrent(self, rows: RecurrentRows, conv_in: torch.Tensor,
                       per_token: PerToken, out: torch.Tensor) -> None:
        assert self.conv_state is not None and self.ssm_state is not None  # run_rows checks
        history = self.conv_state.index_select(0, rows.read_slots)
        state = self.ssm_state.index_select(0, rows.read_slots)
        for tokens, slots in zip(rows.tokens, rows.write_slots, strict=True):
            n = tokens.shape[0]  # the longest rows come first
            conv_out, history = causal_conv_decode(conv_in[tokens], history[:n],
                                                   self.conv_weight, self.conv_bias)
            out[tokens], state = self.scan_step(conv_out, tuple(t[tokens] for t in per_token),
                                                state[:n])
            self.conv_state.index_copy_(0, slots, history)
            self.ssm_state.index_copy_(0, slots, state)
