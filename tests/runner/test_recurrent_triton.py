"""The recurrent layers' CUDA step kernels (runner/models/recurrent_triton.py), run on CPU
by Triton's interpreter against the torch forms they replace: the Mamba2 state update
(groups of heads sharing B and C, head and state sizes not powers of two) and the gated
delta rule (key heads serving several value heads), float32 and bfloat16 inputs, rows
from 1 to 5."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from raylm.runner.models import recurrent_triton  # noqa: E402
from raylm.runner.models.gated_delta import gated_delta_step  # noqa: E402
from raylm.runner.models.ssd import ssd_decode  # noqa: E402

if type(recurrent_triton._mamba2_step_kernel).__name__ != "InterpretedFunction":
    recurrent_triton = importlib.reload(recurrent_triton)  # imported without the interpreter


@pytest.mark.parametrize("rows, heads, groups, head_dim, d_state", [
    (1, 4, 2, 8, 16), (5, 6, 3, 6, 10), (3, 8, 1, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mamba2_step_kernel_equals_the_torch_step(rows, heads, groups, head_dim, d_state,
                                                      dtype):
    gen = torch.Generator().manual_seed(rows + heads)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    x, dt = r(rows, heads, head_dim).to(dtype), (r(rows, heads) * 3).to(dtype)
    A, D, dt_bias = -torch.rand(heads, generator=gen) * 2, r(heads), r(heads)
    B, C = r(rows, groups, d_state).to(dtype), r(rows, groups, d_state).to(dtype)
    state = r(rows, heads, head_dim, d_state)
    y, new = recurrent_triton.mamba2_step(x, dt, A, B, C, D, dt_bias, state)
    y_ref, new_ref = ssd_decode(x, dt, A, B, C, D, dt_bias, state)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new, new_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows, k_heads, v_heads, dk, dv", [
    (1, 2, 4, 8, 6), (5, 1, 3, 12, 16), (2, 4, 4, 16, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_delta_step_kernel_equals_the_torch_step(rows, k_heads, v_heads, dk, dv,
                                                           dtype):
    gen = torch.Generator().manual_seed(rows + v_heads)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = r(rows, k_heads, dk).to(dtype), r(rows, k_heads, dk).to(dtype)
    v = r(rows, v_heads, dv).to(dtype)
    g, beta = -torch.rand(rows, v_heads, generator=gen), torch.rand(rows, v_heads,
                                                                    generator=gen)
    state = r(rows, v_heads, dk, dv)
    out, new = recurrent_triton.gated_delta_step_triton(q, k, v, g, beta, state)
    out_ref, new_ref = gated_delta_step(q, k, v, g, beta, state)
    torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new, new_ref, atol=1e-4, rtol=1e-4)
