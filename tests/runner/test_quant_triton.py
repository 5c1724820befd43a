"""The CUDA quantized-linear kernel (Triton; runner/quantization/triton_linear.py), run on
CPU by Triton's interpreter: 4- and 8-bit codes against dequantize-then-matmul in float64
at 1, 17 and 70 rows (a partial row tile, a partial feature block), float32 and bfloat16
inputs, act order's gathered input; and a GGUF file run end to end on it
(RAYLM_QUANT_BACKEND=triton), equal to transformers on the file, sync and async."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from test_quantized_linear import TOL, _random_group  # noqa: E402

from raylm import LLM, SamplingParams  # noqa: E402
from raylm.runner.loading.gguf_writer import write_gguf_from_hf  # noqa: E402
from raylm.runner.quantization import triton_linear  # noqa: E402
from raylm.runner.quantization.act_order import ActOrderQuantized  # noqa: E402

if type(triton_linear._quant_linear_kernel).__name__ != "InterpretedFunction":
    triton_linear = importlib.reload(triton_linear)  # imported earlier without the interpreter


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_kernel_equals_dequantize_then_matmul(bits, dtype, rows):
    """N=56 (a partial last block of 32 features), K=96 (three groups)."""
    w = _random_group(56, 96, bits, seed=bits)
    layer = triton_linear.TritonQuantLinear(w, "cpu")
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want = x.double() @ w.dequantize().double().t()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 56)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < TOL[dtype], err
    assert torch.equal(layer.rows(torch.tensor([55, 0, 17, 17]), torch.float32),
                       w.dequantize()[[55, 0, 17, 17]])
    assert layer.nbytes() == 56 * 96 * bits // 8 + 2 * 56 * 3 * 4


def test_act_order_input_is_gathered_into_the_weights_order():
    gen = torch.Generator().manual_seed(4)
    n, k = 40, 256
    g_idx = torch.argsort(torch.randperm(k, generator=gen)) // 128
    scale = torch.rand(n, 2, generator=gen) * 0.1 + 0.01
    weight = ActOrderQuantized(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                               g_idx, scale, -scale * 8).narrow(1, 40, 100)
    layer = triton_linear.TritonQuantLinear(weight.to_group(), "cpu")
    x = torch.randn(5, 100, generator=gen)
    want = x.double() @ weight.dequantize().double().t()
    torch.testing.assert_close(layer(x).double(), want, rtol=2e-6,
                               atol=2e-6 * float(want.abs().max()))
    torch.testing.assert_close(layer.dequantize(), weight.dequantize())


@pytest.fixture(scope="module")
def q4_gguf(llama_path, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gguf-q4-triton")
    return write_gguf_from_hf(llama_path, str(folder / "tiny-llama.Q4_0.gguf"), "Q4_0")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_gguf_file_on_the_triton_kernel_equals_transformers(q4_gguf, hf_oracle,
                                                              async_scheduling, monkeypatch):
    monkeypatch.setenv("RAYLM_QUANT_BACKEND", "triton")
    llm = LLM(os.path.dirname(q4_gguf), async_scheduling=async_scheduling, block_size=8,
              max_num_batched_tokens=16)
    try:
        model = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
        kernels = {type(m.quantized).__name__ for m in model.modules()
                   if getattr(m, "quantized", None) is not None}
        assert kernels == {"TritonQuantLinear"}
        prompts = [[5, 17, 99, 260, 3], list(range(3, 40))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_oracle(q4_gguf).greedy(p, 10)
    finally:
        llm.shutdown()
