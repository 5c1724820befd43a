"""GGUF Q6_K kept quantized: its super-blocks decode to int8 codes q - 32 with a scale d x sc
per group of 16 (exactly what the gguf package dequantizes); the C++ kernel's paths and the
Triton kernel (interpreted) at group 16 against dequantize-then-matmul; a merged weight of
Q8_0 (groups of 32) and Q6_K parts runs quantized at 16; a GGUF file with Q6_K tensors
and a Q4_0 k_proj (4-bit codes in groups of 32 merged with 8-bit ones in groups of 16, as
llama.cpp's Q4_K_M mixes) runs quantized, says so in the startup log, and equals
transformers.

Tolerances (of the largest |reference| entry), as test_quantized_linear.py's: float32 rows
2e-6 (float32 accumulation in another order), bfloat16 rows 8e-3."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from test_quantized_linear import TOL, _ctx  # noqa: E402

from raylm import LLM, SamplingParams  # noqa: E402
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint  # noqa: E402
from raylm.runner.loading.gguf_writer import write_gguf_from_hf  # noqa: E402
from raylm.runner.quantization import packed_linear  # noqa: E402
from raylm.runner.quantization.gguf_blocks import LazyGGUFBlocks, decode_group_blocks  # noqa: E402
from raylm.runner.quantization.packed_linear import PackedLinear  # noqa: E402


def _random_q6_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q6_K bytes [rows, cols / 256 * 210] with finite, small super scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
    d = (rng.random(blocks.shape[0]) * 1e-3 + 1e-4).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> Q6_K bytes (the gguf package writes no Q6_K): per 16 weights a
    6-bit scale step, stored as int8 multiples of the super-block's fp16 d."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [super-block, sub-block, element]
    step = np.abs(x).max(-1) / 31.0
    d = (step.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(step / np.where(df > 0, df, 1.0)), 0).clip(-128, 127)
    sub = df * sc
    q = np.where(sub[..., None] > 0, np.round(x / np.where(sub > 0, sub, 1.0)[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [B, half, i, l]
    ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)  # [B, half, 2, 32]
    qh = sum(((q[:, :, i] >> 4) << (2 * i)) for i in range(4)).astype(np.uint8)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                             sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                            axis=1)
    return blocks.reshape(n, k // 256 * 210)


def test_q6_k_decodes_to_what_gguf_dequantizes():
    """Exact: every code -32..31 appears; a narrowed lazy tensor reads its super-block."""
    import gguf

    raw = _random_q6_k(6, 512, seed=1)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(6, 512)
    got = decode_group_blocks("Q6_K", raw, (6, 512))
    assert got.bits == 8 and got.group_size == 16 and got.scale.shape == (6, 32)
    assert int(got.codes.min()) == -32 and int(got.codes.max()) == 31
    assert np.array_equal(got.dequantize().numpy(), want)
    lazy = LazyGGUFBlocks(raw, "Q6_K", (6, 512)).narrow(0, 1, 3).narrow(1, 288, 64)
    assert lazy.bits == 8
    assert np.array_equal(lazy.dequantize().numpy(), want[1:4, 288:352])
    assert lazy.read_bytes[0] == 3 * 210
    # The test's own encoder round-trips through gguf's decoder (used for the file below).
    w = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q6_k(w), gguf.GGMLQuantizationType.Q6_K)
    assert np.abs(back.reshape(4, 256) - w).max() < 0.05 * np.abs(w).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_group_16_kernel_paths_equal_dequantize_then_matmul(dtype, rows, monkeypatch):
    """N=56 (a partial last tile), K=512: 1 and 3 rows fused, 40 decode-then-matmul (or
    AMX tiles for bfloat16 where the CPU has them)."""
    monkeypatch.setattr(packed_linear, "FUSED_MAX_ROWS", 4)
    monkeypatch.setattr(packed_linear, "FUSED_MAX_ROWS_BF16", 4)
    w = decode_group_blocks("Q6_K", _random_q6_k(56, 512, seed=3), (56, 512))
    layer = PackedLinear(w)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want = x.double() @ w.dequantize().double().t()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 56)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < TOL[dtype], err
    assert torch.equal(layer.dequantize(), w.dequantize())
    assert torch.equal(layer.rows(torch.tensor([55, 0, 17]), torch.float32),
                       w.dequantize()[[55, 0, 17]])
    assert layer.nbytes() == 64 * 512 + 64 * 32 * 2 * 4  # 8 + 4 bits a weight, padded tile


@pytest.mark.parametrize("rows", [1, 17])
def test_group_16_triton_kernel_equals_dequantize_then_matmul(rows):
    import importlib

    from raylm.runner.quantization import triton_linear

    if type(triton_linear._quant_linear_kernel).__name__ != "InterpretedFunction":
        triton_linear = importlib.reload(triton_linear)
    w = decode_group_blocks("Q6_K", _random_q6_k(40, 256, seed=4), (40, 256))
    layer = triton_linear.TritonQuantLinear(w, "cpu")
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ w.dequantize().double().t()
    err = (layer(x).double() - want).abs().max() / want.abs().max()
    assert err < TOL[torch.float32], err
    assert torch.equal(layer.dequantize(), w.dequantize())


def test_a_merged_q8_0_and_q6_k_weight_runs_quantized():
    """Q8_0 (scale per 32) beside Q6_K (per 16): both at 16, exactly."""
    import gguf

    from raylm.parallel.layers import MergedColumnParallelLinear
    from raylm.runner.quantization.quantize_model import pack_quantized_weights

    q8 = gguf.quants.quantize(np.random.default_rng(5).standard_normal((32, 256)).astype(
        np.float32), gguf.GGMLQuantizationType.Q8_0)
    gate = decode_group_blocks("Q8_0", q8, (32, 256))
    up = decode_group_blocks("Q6_K", _random_q6_k(32, 256, seed=6), (32, 256))
    layer = MergedColumnParallelLinear(256, [32, 32], False, ctx=_ctx(0, 1),
                                       params_dtype=torch.float32)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    paths = pack_quantized_weights(layer)
    assert paths == {"Q6_K+Q8_0 8-bit kernel": 1}
    assert layer.quantized.group_size == 16
    want = torch.cat([gate.dequantize(), up.dequantize()])
    assert torch.equal(layer.quantized.dequantize(), want)


@pytest.fixture(scope="module")
def q6_k_gguf(tmp_path_factory) -> str:
    """A Llama whose every 2-D weight is Q6_K but k_proj (Q4_0): rows of 256 and 512."""
    import gguf

    spec = CheckpointSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, initializer_range=0.1, seed=13)
    hf = write_random_checkpoint(str(tmp_path_factory.mktemp("q6k-hf")), spec)
    quantize, add_tensor = gguf.quants.quantize, gguf.GGUFWriter.add_tensor
    calls = []

    def q6_k(data: np.ndarray, qtype):
        calls.append(data.shape)
        return quantize_q6_k(data)

    def add(self, name, tensor, *args, raw_dtype=None, **kwargs):
        if name.endswith("attn_k.weight"):  # its Q6_K values, written as Q4_0
            calls.pop()
            raw_dtype = gguf.GGMLQuantizationType.Q4_0
            tensor = quantize(gguf.quants.dequantize(tensor, gguf.GGMLQuantizationType.Q6_K),
                              raw_dtype)
        return add_tensor(self, name, tensor, *args, raw_dtype=raw_dtype, **kwargs)

    gguf.quants.quantize, gguf.GGUFWriter.add_tensor = q6_k, add
    try:
        path = str(tmp_path_factory.mktemp("q6k") / "tiny-llama.Q6_K.gguf")
        write_gguf_from_hf(hf, path, "Q6_K")
    finally:
        gguf.quants.quantize, gguf.GGUFWriter.add_tensor = quantize, add_tensor
    assert len(calls) == 2 * 6 + 2  # per layer q, v, o, gate, up, down; embedding; head
    return path


def test_a_q6_k_gguf_runs_quantized_equal_to_transformers_on_it(q6_k_gguf, hf_oracle, caplog):
    from gguf import GGUFReader

    kinds = {t.name: t.tensor_type.name for t in GGUFReader(q6_k_gguf).tensors}
    assert kinds["blk.0.attn_k.weight"] == "Q4_0" and kinds["blk.0.ffn_down.weight"] == "Q6_K"
    with caplog.at_level(logging.INFO, logger="raylm.runner.quantization.quantize_model"):
        llm = LLM(os.path.dirname(q6_k_gguf), block_size=8, max_num_batched_tokens=16)
    try:
        log = " ".join(r.getMessage() for r in caplog.records)
        # per layer o, gate_up, down; embedding; head in Q6_K; q/k/v merged with the Q4_0
        # k, its codes widened to 8 bits
        assert "2 x Q4_0+Q6_K 8-bit kernel" in log and "8 x Q6_K 8-bit kernel" in log, log
        assert "dense" not in log
        prompts = [[5, 17, 99, 260, 3], list(range(3, 40))]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        oracle = hf_oracle(q6_k_gguf)
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(p, 10)
    finally:
        llm.shutdown()

