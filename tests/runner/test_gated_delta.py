"""runner/models/gated_delta.py: the gated delta rule's chunked form equals its token-by-
token recurrence from any initial state and for any chunking, and transformers' torch
chunked and recurrent functions (grouped value heads, q and k L2-normalised in them)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from raylm.runner.models.gated_delta import gated_delta_chunked, gated_delta_step

HK, HV, DK, DV = 2, 4, 8, 6


def _inputs(length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(length, HK, DK, generator=gen),
                k=torch.randn(length, HK, DK, generator=gen),
                v=torch.randn(length, HV, DV, generator=gen),
                g=-torch.rand(length, HV, generator=gen),
                beta=torch.rand(length, HV, generator=gen))


def _recurrence(inp, state):
    outs, state = [], state[None]
    for t in range(inp["q"].shape[0]):
        o, state = gated_delta_step(*(inp[n][t:t + 1] for n in ("q", "k", "v", "g", "beta")),
                                    state)
        outs.append(o)
    return torch.cat(outs), state[0]


@pytest.mark.parametrize("length, chunk", [(1, 4), (7, 4), (8, 4), (13, 4), (13, 64)])
@pytest.mark.parametrize("with_state", [False, True], ids=["zeros", "carried"])
def test_the_chunked_rule_equals_the_recurrence(length, chunk, with_state):
    inp = _inputs(length)
    init = torch.randn(HV, DK, DV) if with_state else None
    out, final = gated_delta_chunked(**inp, chunk_size=chunk, initial_state=init)
    ref, ref_final = _recurrence(inp, init if with_state else torch.zeros(HV, DK, DV))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)


def test_both_forms_equal_transformers():
    inp = _inputs(13, seed=1)
    init = torch.randn(HV, DK, DV)
    batched = {n: t[None] for n, t in inp.items()}
    out, final = gated_delta_chunked(**inp, chunk_size=4, initial_state=init)
    out_hf, final_hf = hf.torch_chunk_gated_delta_rule(
        batched["q"], batched["k"], batched["v"], batched["g"], batched["beta"], chunk_size=4,
        initial_state=init[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, out_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_hf[0], atol=1e-5, rtol=1e-5)
    one = {n: t[:, :1] for n, t in batched.items()}
    step, state = gated_delta_step(*(inp[n][:1] for n in ("q", "k", "v", "g", "beta")),
                                   init[None])
    step_hf, state_hf = hf.torch_recurrent_gated_delta_rule(
        one["q"], one["k"], one["v"], one["g"], one["beta"], initial_state=init[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(step, step_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, state_hf, atol=1e-5, rtol=1e-5)
