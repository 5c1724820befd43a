"""Mamba2's state-space step in torch (the structured state-space duality, SSD), for one
request's span of tokens or a batch of one-token decodes.

Shapes per rank: ``x`` [L, H, P] (H heads of P channels), ``B`` and ``C`` [L, G, N]
(G groups of N states; head h reads group h // (H / G)), ``dt`` [L, H], the state
[H, P, N] (float32). A span's output and final state equal running the recurrence
``s = exp(dt A) s + dt B x; y = C s + D x`` token by token; the chunked form computes
it in chunks of ``chunk_size`` (quadratic inside a chunk, a recurrence between chunks)
as transformers' torch path does, the decode form is the recurrence itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each head its group's row."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def _discretized_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                    limit: tuple[float, float] | None) -> torch.Tensor:
    dt = F.softplus(dt.float() + dt_bias.float())
    if limit is not None:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def causal_conv_span(x: torch.Tensor, history: torch.Tensor | None, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU of one span. ``x`` [L, D], ``history`` [D, K-1]
    (the inputs before the span; None: zeros, a fresh request), ``weight`` [D, K].
    Returns (output [L, D], the new history [D, K-1])."""
    k = weight.shape[1]
    seq = x.t().to(weight.dtype)
    if history is None:
        history = seq.new_zeros(seq.shape[0], k - 1)
    full = torch.cat([history.to(seq.dtype), seq], dim=1)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=full.shape[0])[0]
    return F.silu(out).t().to(x.dtype), full[:, full.shape[1] - (k - 1):]


def causal_conv_decode(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: ``x`` [R, D], ``history`` [R, D, K-1]. Returns (output [R, D],
    the new histories [R, D, K-1])."""
    full = torch.cat([history.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)
    out = (full * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype), full[..., 1:]


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, chunk_size: int,
                initial_state: torch.Tensor | None,
                dt_limit: tuple[float, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One span's scan. Returns (y [L, H, P] in float32, final state [H, P, N] float32)."""
    length, heads, head_dim = x.shape
    dt = _discretized_dt(dt, dt_bias, dt_limit)  # [L, H]
    xf = x.float()
    Bh, Ch = _per_head(B.float(), heads), _per_head(C.float(), heads)  # [L, H, N]
    pad = (-length) % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [c, l, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(chunks, chunk_size, *t.shape[1:])

    xdt = chunked(xf * dt[..., None])  # [c, l, H, P]
    a = chunked(A.float() * dt)  # [c, l, H]
    Bc, Cc = chunked(Bh), chunked(Ch)  # [c, l, H, N]
    a_cum = a.cumsum(dim=1)  # [c, l, H]
    # Decay from position s to l (l >= s) inside a chunk: exp(sum a[s+1..l]).
    seg = a_cum[:, :, None, :] - a_cum[:, None, :, :]  # [c, l, s, H]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", Cc, Bc) * decay
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)
    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(a_cum[:, -1:, :] - a_cum)  # [c, l, H]
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", Bc, to_end, xdt)
    state = (initial_state.float() if initial_state is not None
             else x.new_zeros((heads, head_dim, Bh.shape[-1]), dtype=torch.float32))
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = state * torch.exp(a_cum[c, -1])[:, None, None] + chunk_states[c]
    start = torch.stack(starts)  # [c, H, P, N]: the state entering each chunk
    y = y + torch.einsum("clhn,chpn,clh->clhp", Cc, start, torch.exp(a_cum))
    y = y.reshape(chunks * chunk_size, heads, head_dim)[:length]
    return y + xf * D.float()[:, None], state


def ssd_decode(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: ``x`` [R, H, P], ``dt`` [R, H], ``B``/``C`` [R, G, N], ``state``
    [R, H, P, N]. Returns (y [R, H, P] float32, the new states). On CUDA one fused Triton
    kernel (recurrent_triton.py) does the same."""
    if x.is_cuda:
        from raylm.runner.models.recurrent_triton import mamba2_step

        return mamba2_step(x, dt, A, B, C, D, dt_bias, state)
    return ssd_decode_torch(x, dt, A, B, C, D, dt_bias, state)


def ssd_decode_torch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ssd_decode`` in torch operations, on any device (the kernel's reference)."""
    heads = x.shape[1]
    dt = _discretized_dt(dt, dt_bias, None)  # [R, H]
    Bh, Ch = _per_head(B.float(), heads), _per_head(C.float(), heads)  # [R, H, N]
    xf = x.float()
    decay = torch.exp(dt * A.float())[..., None, None]
    new_state = state.float() * decay + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("rhpn,rhn->rhp", new_state, Ch)
    return y + xf * D.float()[:, None], new_state
