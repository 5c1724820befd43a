"""The gated delta rule (Qwen3-Next's linear attention) in torch, for one request's span of
tokens or a batch of one-token rows.

Shapes per rank: ``q`` and ``k`` [L, Hk, Dk], ``v`` [L, Hv, Dv] (each key head serves
Hv / Hk consecutive value heads), ``g`` (the log decay, <= 0) and ``beta`` [L, Hv], the
state [Hv, Dk, Dv] float32. Per token, with q and k L2-normalised and q scaled by
Dk^-1/2: ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q``. The chunked form
computes the same in chunks of ``chunk_size``: inside a chunk the updates are folded into
a unit lower-triangular system (the WY / UT transform) solved once, between chunks the
state carries, as transformers' torch path does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _prepared(q: torch.Tensor, k: torch.Tensor, heads: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k per value head, L2-normalised, q scaled (float32)."""
    q = q.float().repeat_interleave(heads // q.shape[-2], dim=-2)
    k = k.float().repeat_interleave(heads // k.shape[-2], dim=-2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: ``state`` [R, Hv, Dk, Dv]. Returns (o [R, Hv, Dv] float32, the
    new states). On CUDA one fused Triton kernel (recurrent_triton.py) does the same."""
    if v.is_cuda:
        from raylm.runner.models.recurrent_triton import gated_delta_step_triton

        return gated_delta_step_triton(q, k, v, g, beta, state)
    return gated_delta_step_torch(q, k, v, g, beta, state)


def gated_delta_step_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_step`` in torch operations, on any device (the kernel's reference)."""
    q, k = _prepared(q, k, v.shape[-2])
    state = state.float() * g.float().exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)  # [R, Hv, Dv]
    delta = (v.float() - remembered) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, chunk_size: int,
                        initial_state: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One span. Returns (o [L, Hv, Dv] float32, the final state [Hv, Dk, Dv])."""
    length, heads, dv = v.shape
    q, k = _prepared(q, k, heads)
    pad = (-length) % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, c, l, ...]
        t = F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad))
        t = t.reshape(chunks, chunk_size, *t.shape[1:])
        return t.movedim(2, 0)

    qc, kc, vc = chunked(q), chunked(k), chunked(v)  # [H, c, l, D]
    gc, bc = chunked(g[..., None])[..., 0], chunked(beta[..., None])[..., 0]  # [H, c, l]
    cum = gc.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = kc * bc[..., None]
    # T = I + strictly-lower(diag(beta) K K^T * decay): the chunk's updates folded together.
    system = (kb @ kc.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False,
                                           unitriangular=True)
    keys = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False,
                                         unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]
    state = (initial_state.float() if initial_state is not None
             else v.new_zeros((heads, k.shape[-1], dv), dtype=torch.float32))
    out = torch.empty_like(vc)
    for c in range(chunks):
        fresh = values[:, c] - keys[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ fresh
        state = state * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ fresh
    out = out.movedim(0, 2).reshape(chunks * chunk_size, heads, dv)[:length]
    return out, state
