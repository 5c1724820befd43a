"""runner/models/ssd.py and runner/state_cache.py: Mamba2's chunked scan equals the
token-by-token recurrence from any initial state, and transformers' torch scan and state
update; the causal convolution's span and decode forms equal transformers'; a span cut in
two carries state and history across the cut; state slot groups are handed out and back
once, and each step reads the slot holding the state after its last computed token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.bamba import modeling_bamba as hf

from raylm.runner.models.ssd import (
    causal_conv_decode,
    causal_conv_span,
    ssd_chunked,
    ssd_decode,
)
from raylm.runner.state_cache import StateMetadata, StateSlots, StateSpan, state_read_slots

H, P, G, N = 4, 3, 2, 5


def _inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(x=r(length, H, P), dt=r(length, H), A=-torch.rand(H, generator=gen) * 2,
                B=r(length, G, N), C=r(length, G, N), D=r(H), dt_bias=r(H))


def _recurrence(inp, state):
    ys = []
    state = state[None]
    for t in range(inp["x"].shape[0]):
        y, state = ssd_decode(inp["x"][t:t + 1], inp["dt"][t:t + 1], inp["A"],
                              inp["B"][t:t + 1], inp["C"][t:t + 1], inp["D"], inp["dt_bias"],
                              state)
        ys.append(y)
    return torch.cat(ys), state[0]


@pytest.mark.parametrize("length, chunk", [(1, 4), (7, 4), (8, 4), (13, 4), (13, 32)])
@pytest.mark.parametrize("with_state", [False, True], ids=["zeros", "carried"])
def test_the_chunked_scan_equals_the_recurrence(length, chunk, with_state):
    inp = _inputs(length)
    init = torch.randn(H, P, N) if with_state else None
    y, final = ssd_chunked(**inp, chunk_size=chunk, initial_state=init, dt_limit=None)
    y_ref, final_ref = _recurrence(inp, init if with_state else torch.zeros(H, P, N))
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-5)


def test_the_scan_and_the_decode_step_equal_transformers():
    inp = _inputs(13, seed=1)
    init = torch.randn(H, P, N)
    y, final = ssd_chunked(**inp, chunk_size=4, initial_state=init, dt_limit=(0.0, 0.5))
    y_hf, final_hf = hf.mamba2_chunk_scan(
        inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None], inp["C"][None], 4,
        D=inp["D"], dt_bias=inp["dt_bias"], initial_states=init[None], dt_softplus=True,
        dt_limit=(0.0, 0.5), return_final_states=True)
    torch.testing.assert_close(y, y_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_hf[0], atol=1e-5, rtol=1e-5)
    one = _inputs(1, seed=2)
    state = torch.randn(H, P, N)
    y1, new = ssd_decode(one["x"], one["dt"], one["A"], one["B"], one["C"], one["D"],
                         one["dt_bias"], state[None])
    hf_state = state[None].clone()
    y1_hf = hf.mamba2_selective_state_update(
        hf_state, one["x"], one["dt"][..., None].expand(-1, -1, P),
        one["A"][:, None, None].expand(-1, P, N), one["B"], one["C"],
        one["D"][:, None].expand(-1, P), dt_bias=one["dt_bias"][:, None].expand(-1, P),
        dt_softplus=True)
    torch.testing.assert_close(y1, y1_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new, hf_state, atol=1e-5, rtol=1e-5)


def test_a_span_cut_in_two_carries_its_state_and_history():
    inp = _inputs(11, seed=3)
    y, final = ssd_chunked(**inp, chunk_size=4, initial_state=None, dt_limit=None)
    first = {k: v[:6] if v.shape[0] == 11 else v for k, v in inp.items()}
    second = {k: v[6:] if v.shape[0] == 11 else v for k, v in inp.items()}
    y1, mid = ssd_chunked(**first, chunk_size=4, initial_state=None, dt_limit=None)
    y2, end = ssd_chunked(**second, chunk_size=4, initial_state=mid, dt_limit=None)
    torch.testing.assert_close(torch.cat([y1, y2]), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)
    # The convolution: one span, two spans, and token-by-token decodes agree.
    channels, k = 6, 4
    x = torch.randn(11, channels)
    weight, bias = torch.randn(channels, k), torch.randn(channels)
    whole, history = causal_conv_span(x, None, weight, bias)
    ref = torch.nn.functional.silu(hf.causal_conv1d_fn(x.t()[None], weight, bias)[0].t())
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
    a, hist = causal_conv_span(x[:2], None, weight, bias)  # shorter than the kernel
    b, hist = causal_conv_span(x[2:7], hist, weight, bias)
    steps = []
    hist_rows = hist[None]
    for t in range(7, 11):
        out, hist_rows = causal_conv_decode(x[t:t + 1], hist_rows, weight, bias)
        steps.append(out)
    torch.testing.assert_close(torch.cat([a, b, *steps]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hist_rows[0], history)


def test_state_groups_are_handed_out_once_and_come_back():
    slots = StateSlots(2, slots_per_request=4)
    assert slots.num_slots == 8
    assert [slots.assign("a"), slots.assign("b")] == [0, 1]
    with pytest.raises(ValueError, match="'a' already holds"):
        slots.assign("a")
    with pytest.raises(RuntimeError, match="all 2 state groups"):
        slots.assign("c")
    slots.release("a")
    slots.release("a")  # a request dropped twice (finished, then in a later diff) is fine
    assert slots.assign("c") == 0 and slots.num_held == 2


def test_each_row_reads_the_state_after_its_last_computed_token():
    """Groups of 4 slots (3 drafts). Rows: a fresh prefill; a decode after a decode; a
    verification step after one that accepted 2 of 3 drafts (its state after position 12
    is in slot 2 of the four written from position 10); a chunk after a chunk (the state
    in slot 0); a verification step's 4 tokens."""
    bases = np.array([-1, 8, 10, 19, 30])
    groups = np.array([0, 1, 2, 3, 4])
    computed = np.array([0, 9, 13, 20, 31])
    scheduled = np.array([7, 1, 4, 6, 4])
    reads, new_bases = state_read_slots(bases, groups, computed, scheduled, 4)
    assert reads.tolist() == [-1, 4, 8 + 2, 12, 16]
    # Recurrent rows (at most 4 tokens, continuing) leave slot j = position base + j;
    # spans their final state in slot 0.
    assert new_bases.tolist() == [6, 9, 13, 25, 31]
    with pytest.raises(RuntimeError, match="not among its slots"):
        state_read_slots(np.array([10]), np.array([0]), np.array([15]), np.array([1]), 4)


def test_the_step_metadata_runs_short_continuations_together_and_spans_alone():
    # Rows: a fresh prefill (3 tokens); a decode; a later chunk (5 tokens: a span, longer
    # than the 4 slots); a fresh one-token prompt (zeros: a span); a 3-token verification.
    qsl = np.array([0, 3, 4, 9, 10, 13])
    reads = np.array([-1, 5, 8, -1, 13])
    meta = StateMetadata.build(qsl, reads, np.array([0, 1, 2, 3, 4]), 4, torch.device("cpu"))
    assert meta.spans == [StateSpan(0, 3, -1, 0), StateSpan(4, 9, 8, 8),
                          StateSpan(9, 10, -1, 12)]
    rec = meta.recurrent
    assert rec is not None
    # Longest first: the verification (group 4), then the decode (group 1).
    assert rec.read_slots.tolist() == [13, 5]
    assert [t.tolist() for t in rec.tokens] == [[10, 3], [11], [12]]
    assert [w.tolist() for w in rec.write_slots] == [[16, 4], [17], [18]]
