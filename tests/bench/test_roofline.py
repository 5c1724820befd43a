"""bench/roofline.py's accounting: the FLOPs and bytes of a step on a tiny config against
figures worked out by hand, the roofline bound, and the table's derived columns, so the
fractions it prints rest on the right numerators (no model is loaded)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "roofline.py")

# hidden 8, 2 layers, 2 query heads sharing 1 KV head of 4, MLP 16, vocab 32.
TINY = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32}


@pytest.fixture(scope="module")
def rl():
    spec = importlib.util.spec_from_file_location("roofline_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_step_work_on_a_tiny_config(rl):
    shape = rl.ModelShape.from_config(TINY)
    step = rl.Step(prefill=3, decode=2, context=5)  # 5 tokens, 3 sampled rows
    assert (step.tokens, step.sampled) == (5, 3)
    work = rl.step_work(shape, step, elem=4)
    # (FLOPs, bytes), by hand; linears: 2*rows*k*n and (k*n + rows*k + rows*n) elements,
    # times 2 layers, 4 bytes each.
    expected = {
        "qkv_proj": (2 * 5 * 8 * 16 * 2, (8 * 16 + 5 * 8 + 5 * 16) * 4 * 2),  # n = 8 + 2 * 4
        "o_proj": (2 * 5 * 8 * 8 * 2, (8 * 8 + 5 * 8 + 5 * 8) * 4 * 2),
        "gate_up_proj": (2 * 5 * 8 * 32 * 2, (8 * 32 + 5 * 8 + 5 * 32) * 4 * 2),
        "down_proj": (2 * 5 * 16 * 8 * 2, (16 * 8 + 5 * 16 + 5 * 8) * 4 * 2),
        # 3*4/2 causal prefill pairs + 2 rows x 5 = 16 pairs, 4 FLOPs x 2 heads x 4 dims each;
        # Q + out 80, new K/V in + written 80, cached K/V read (3 + 2*5) x 8 = 104 elements
        "attention": (1024, 2112),
        # 3 rows x 8 x 32; weight 256 + input 24 elements, float32 logits 96 x 4 bytes
        "lm_head": (1536, 1504),
        "sampling": (96, 3 * 32 * 4 + 3 * 8),
    }
    assert set(work) == set(expected) == set(rl.COMPONENTS)
    for name, (flops, nbytes) in expected.items():
        assert (work[name].flops, work[name].bytes) == (flops, nbytes), name
    # bfloat16 halves every byte but the float32 logits and the sampled ids.
    half = rl.step_work(shape, step, elem=2)
    assert half["qkv_proj"].bytes == expected["qkv_proj"][1] / 2
    assert half["lm_head"].bytes == (256 + 24) * 2 + 96 * 4
    assert half["sampling"].bytes == expected["sampling"][1]


def test_gemm_shapes(rl):
    shape = rl.ModelShape.from_config(TINY)
    shapes = rl.gemm_shapes(shape, rl.Step(prefill=3, decode=2, context=5))
    assert shapes == {"qkv_proj": (5, 8, 16), "o_proj": (5, 8, 8), "gate_up_proj": (5, 8, 32),
                      "down_proj": (5, 16, 8), "attention": (3, 4, 3), "lm_head": (3, 8, 32)}
    # Decode only: 2 rows x 2 query heads of the one KV head against 5 keys; 2 sampled.
    decode = rl.gemm_shapes(shape, rl.Step(prefill=0, decode=2, context=5))
    assert decode["attention"] == (4, 4, 5) and decode["qkv_proj"] == (2, 8, 16)
    assert decode["lm_head"] == (2, 8, 32)


def test_a_decode_token_costs_twice_the_linear_parameters(rl):
    """SmolLM2-135M: one decode row's linears and head = 2 FLOPs per weight (134.5M)."""
    smol = rl.ModelShape.from_config({
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152})
    assert smol.head_dim == 64  # 576 / 9 when the config names none
    work = rl.step_work(smol, rl.Step(prefill=0, decode=1, context=1), elem=4)
    linears = sum(work[c].flops for c in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                          "lm_head"))
    assert linears == 2 * 134_479_872


def test_roofline_and_table_columns(rl):
    w = rl.Work(flops=100.0, bytes=10.0)  # 10 FLOP/B
    assert rl.roofline(w, peak_flops=50.0, bandwidth=2.0) == 20.0  # memory-bound
    assert rl.roofline(w, peak_flops=15.0, bandwidth=2.0) == 15.0  # compute-bound
    assert rl.roofline(w, peak_flops=None, bandwidth=2.0) == 20.0  # no matmul
    work = {c: rl.Work(2e9, 1e9) for c in rl.COMPONENTS}
    seconds = dict.fromkeys(rl.COMPONENTS, 0.5)  # 4 GFLOP/s, 2 GB/s achieved
    peaks = {c: 8e9 for c in rl.COMPONENTS if c != "sampling"}
    rows = {r["component"]: r for r in rl.rows_of(work, seconds, peaks, bandwidth=10e9)}
    head = rows["lm_head"]
    assert head["achieved"] == pytest.approx(4.0) and head["fraction"] == pytest.approx(0.5)
    assert head["bw_fraction"] == pytest.approx(0.2)
    assert head["roofline"] == pytest.approx(8.0)  # 2 FLOP/B x 10 GB/s = 20 > peak 8
    assert head["lost_ms"] == pytest.approx(250.0)  # 0.5 s against 0.25 s at the roofline
    samp = rows["sampling"]
    assert samp["peak"] is None and samp["fraction"] is None
    assert samp["of_roofline"] == pytest.approx(0.2)  # against 20 GFLOP/s fed by memory


def test_probe_steps_are_told_by_their_composition(rl):
    """A SchedulerOutput's (prefill tokens, decode rows, mean decode context)."""
    cached = SimpleNamespace(req_ids=["a", "b", "c"], num_computed_tokens=[40, 50, 7])
    so = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1, "c": 9, "new": 256},
                         scheduled_cached_reqs=cached)
    assert rl._composition(so) == (265, 2, 46.0)
