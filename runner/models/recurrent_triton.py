"""Triton kernels for the recurrent layers' one-token step on CUDA: the Mamba2 state update
and the gated delta rule, one program per (row, head), state and inputs read once, every
operation of the torch form (runner/models/ssd.py, gated_delta.py) fused into it, float32
inside. The torch forms are the references: CI runs these kernels on CPU under
TRITON_INTERPRET=1 against them (tests/runner/test_recurrent_triton.py), and
bench/gpu_check.py on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    # torch's softplus (threshold 20: linear above it)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _mamba2_step_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr,
                        y_ptr, new_state_ptr, heads, groups, head_dim, d_state,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    group = head // (heads // groups)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < head_dim, n < d_state
    x = tl.load(x_ptr + (row * heads + head) * head_dim + p, mask=p_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * heads + head).to(tl.float32)
    dt = _softplus(dt + tl.load(dt_bias_ptr + head).to(tl.float32))
    a = tl.load(a_ptr + head).to(tl.float32)
    bc = (row * groups + group) * d_state + n
    b = tl.load(b_ptr + bc, mask=n_ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + bc, mask=n_ok, other=0.0).to(tl.float32)
    offs = ((row * heads + head) * head_dim + p[:, None]) * d_state + n[None, :]
    mask = p_ok[:, None] & n_ok[None, :]
    state = tl.load(state_ptr + offs, mask=mask, other=0.0)
    state = state * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
    tl.store(new_state_ptr + offs, state, mask=mask)
    y = tl.sum(state * c[None, :], axis=1) + x * tl.load(d_ptr + head).to(tl.float32)
    tl.store(y_ptr + (row * heads + head) * head_dim + p, y, mask=p_ok)


def mamba2_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd.ssd_decode's contract: ``x`` [R, H, P], ``dt`` [R, H], ``B``/``C`` [R, G, N],
    ``state`` [R, H, P, N]; returns (y [R, H, P] float32, new states float32)."""
    rows, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    y = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=x.device)
    new_state = torch.empty(state.shape, dtype=torch.float32, device=x.device)
    if rows:
        _mamba2_step_kernel[(rows, heads)](
            x.contiguous(), dt.contiguous(), A.float().contiguous(), B.contiguous(),
            C.contiguous(), D.contiguous(), dt_bias.contiguous(),
            state.float().contiguous(), y, new_state, heads, groups, head_dim, d_state,
            BLOCK_P=triton.next_power_of_2(head_dim), BLOCK_N=triton.next_power_of_2(d_state))
    return y, new_state


@triton.jit
def _gated_delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr,
                             new_state_ptr, k_heads, v_heads, dk, dv, scale,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    k_head = head // (v_heads // k_heads)
    i = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_V)
    i_ok, j_ok = i < dk, j < dv
    qk = (row * k_heads + k_head) * dk + i
    q = tl.load(q_ptr + qk, mask=i_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk, mask=i_ok, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + (row * v_heads + head) * dv + j, mask=j_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * v_heads + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * v_heads + head).to(tl.float32)
    offs = ((row * v_heads + head) * dk + i[:, None]) * dv + j[None, :]
    mask = i_ok[:, None] & j_ok[None, :]
    state = tl.load(state_ptr + offs, mask=mask, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(new_state_ptr + offs, state, mask=mask)
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(o_ptr + (row * v_heads + head) * dv + j, o, mask=j_ok)


def gated_delta_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta.gated_delta_step's contract: ``q``/``k`` [R, Hk, Dk], ``v`` [R, Hv, Dv],
    ``g``/``beta`` [R, Hv], ``state`` [R, Hv, Dk, Dv]; returns (o [R, Hv, Dv] float32, the
    new states float32)."""
    rows, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    out = torch.empty(rows, v_heads, dv, dtype=torch.float32, device=v.device)
    new_state = torch.empty(state.shape, dtype=torch.float32, device=v.device)
    if rows:
        _gated_delta_step_kernel[(rows, v_heads)](
            q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
            beta.float().contiguous(), state.float().contiguous(), out, new_state, k_heads,
            v_heads, dk, dv, dk ** -0.5, BLOCK_K=triton.next_power_of_2(dk),
            BLOCK_V=triton.next_power_of_2(dv))
    return out, new_state
