"""runner/models/fused_ops.py: the compiled residual add + RMSNorm and rotary embedding equal
the eager ones (transformers' numerics) for every token count from one compile each, and
an engine that compiles them gives transformers' greedy tokens. On CPU they are compiled
only where asked (inductor's C++ backend); on CUDA by default."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.runner.models import fused_ops
from raylm.runner.models.fused_ops import EAGER_OPS, compiled_ops, resolve_fused_ops


def test_compiled_on_cuda_unless_enforce_eager_and_off_on_cpu_unless_asked():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_fused_ops(None, cuda, enforce_eager=False).compiled
    assert resolve_fused_ops(None, cuda, enforce_eager=True) is EAGER_OPS
    assert resolve_fused_ops(None, cpu, enforce_eager=False) is EAGER_OPS
    assert resolve_fused_ops(True, cpu, enforce_eager=False).compiled
    assert resolve_fused_ops(False, cuda, enforce_eager=False) is EAGER_OPS


def test_a_function_that_does_not_compile_runs_eagerly():
    def branchy(x: torch.Tensor) -> torch.Tensor:
        # Data-dependent control flow: fullgraph=True refuses it.
        return x * 2 if x.sum().item() > 0 else x * 3

    op = fused_ops._CompiledOrEager(branchy)
    ops = fused_ops.FusedOps(op, compiled_ops().add_rms_norm, compiled_ops().rotary)
    assert ops.compiled
    x = torch.ones(4)
    assert torch.equal(op(x), x * 2)
    assert op.compiled is None  # it fell back, and stays eager
    assert not ops.compiled  # and the ops say so
    assert torch.equal(op(-x), -x * 3)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ops_equal_the_eager_ops_for_every_token_count(dtype):
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    stats.clear()
    ops = compiled_ops()
    gen = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, head_dim = 64, 4, 2, 16
    weight = torch.randn(hidden, generator=gen).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    graphs_after = {}
    for t in (1, 3, 17, 64):
        x = torch.randn(t, hidden, generator=gen).to(dtype)
        res = torch.randn(t, hidden, generator=gen).to(dtype)
        got, got_sum = ops.add_rms_norm(x, res, weight, 1e-6)
        want, want_sum = EAGER_OPS.add_rms_norm(x, res, weight, 1e-6)
        assert torch.equal(got_sum, want_sum)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6),
                                   EAGER_OPS.rms_norm(x, weight, 1e-6), **tol)
        q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
        angles = torch.randn(t, 1, head_dim // 2, generator=gen).repeat(1, 1, 2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        for g, w in zip(ops.rotary(cos, sin, q, k), EAGER_OPS.rotary(cos, sin, q, k),
                        strict=True):
            torch.testing.assert_close(g, w, **tol)
        graphs_after[t] = stats["unique_graphs"]
    # One token (torch.compile specialises sizes 0 and 1) and one dynamic graph per
    # function serve every token count: no recompile per decode batch size.
    assert graphs_after[3] <= 6 and graphs_after[64] == graphs_after[3], graphs_after


@pytest.mark.timeout(600)
def test_engine_with_compiled_ops_gives_transformers_greedy_tokens(llama_path, hf_oracle):
    llm = LLM(llama_path, compile_fused_ops=True, num_kv_blocks=64, block_size=8)
    try:
        model = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
        assert model.model.norm.ops.compiled
        prompts = [[5, 9, 13, 21, 34, 55, 89], list(range(3, 40)), [7] * 12]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    oracle = hf_oracle(llama_path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 16)
