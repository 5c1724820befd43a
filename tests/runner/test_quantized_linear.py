"""Quantized weights (runner/quantization): GGUF blocks decoded to codes, scales and zeros
exactly as the gguf package dequantizes them; the C++ kernel's three paths (fused for few
rows, AMX tiles for many bfloat16 rows, decode-then-matmul for many float32 rows) against
dequantize-then-matmul in float64; a GGUF file loaded kept quantized, TP-sliced per rank,
and equal to transformers on it.

Tolerances (of the largest |reference| entry): float32 rows 2e-6 (float32 accumulation in
another order); bfloat16 rows 8e-3 (the output rounded to bfloat16, and on the AMX path the
decoded weight too, as the dense bfloat16 path rounds it at load)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import QuantizableWeight
from raylm.runner.loading.gguf_checkpoint import read_gguf_config
from raylm.runner.loading.gguf_writer import write_gguf_from_hf
from raylm.runner.loading.model_loader import get_model
from raylm.runner.quantization import packed_linear
from raylm.runner.quantization.gguf_blocks import decode_group_blocks
from raylm.runner.quantization.group_quantized import GroupQuantized
from raylm.runner.quantization.packed_linear import PackedLinear
from raylm.scheduler.config.engine_config import ModelConfig

TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


def _random_group(n: int, k: int, bits: int, seed: int = 0) -> GroupQuantized:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        zero = torch.randn(n, k // 32, generator=gen) * 0.05
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        zero = torch.zeros(n, k // 32)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    return GroupQuantized(codes, scale, zero, bits, f"random{bits}")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_gguf_blocks_decode_to_what_gguf_dequantizes(qtype):
    import gguf

    data = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(data, kind)
    want = gguf.quants.dequantize(raw, kind).reshape(24, 96)
    got = decode_group_blocks(qtype, raw, (24, 96))
    assert got.bits == (4 if qtype.startswith("Q4") else 8)
    assert np.array_equal(got.dequantize().numpy(), want)
    if qtype.startswith("Q5"):  # every fifth bit used: the codes span 0..31
        assert got.codes.min() == 0 and got.codes.max() == 31


@pytest.mark.parametrize("qtype, nbytes", [("Q4_K", 144), ("Q5_K", 176)])
def test_k_super_blocks_decode_to_what_gguf_dequantizes(qtype, nbytes):
    """Q4_K, Q5_K (gguf-py cannot quantize to them): random super-blocks with finite
    scales; a narrowed lazy tensor reads and decodes only its rows and columns."""
    import gguf

    from raylm.runner.quantization.gguf_blocks import LazyGGUFBlocks

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(6 * 2, nbytes), dtype=np.uint8)  # 6 rows x 512
    blocks[:, 0:4] = np.array([0.01, 0.003], dtype=np.float16).view(np.uint8)
    raw = blocks.reshape(6, 2 * nbytes)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(6, 512)
    got = decode_group_blocks(qtype, raw, (6, 512))
    assert np.array_equal(got.dequantize().numpy(), want)
    assert got.bits == (4 if qtype == "Q4_K" else 8)
    lazy = LazyGGUFBlocks(raw, qtype, (6, 512)).narrow(0, 1, 3).narrow(1, 288, 64)
    assert np.array_equal(lazy.dequantize().numpy(), want[1:4, 288:352])
    assert lazy.read_bytes[0] == 3 * nbytes  # the one super-block the columns fall in


def test_narrowing_keeps_groups_whole():
    w = _random_group(8, 128, 4)
    assert torch.equal(w.narrow(1, 64, 64).dequantize(), w.dequantize()[:, 64:])
    assert torch.equal(w.narrow(0, 2, 3).dequantize(), w.dequantize()[2:5])
    with pytest.raises(ValueError, match=r"groups of 32; columns \[16, 48\)"):
        w.narrow(1, 16, 32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_kernel_paths_equal_dequantize_then_matmul(bits, dtype, rows, monkeypatch):
    """N=56 (a partial last tile of 16), K=96 (three groups). The row thresholds are set so
    that 1 and 3 rows take the fused kernel, 8 and 40 the AMX tiles (bfloat16, where the CPU
    has them) or the decode-then-matmul path."""
    monkeypatch.setattr(packed_linear, "FUSED_MAX_ROWS", 4)
    monkeypatch.setattr(packed_linear, "FUSED_MAX_ROWS_BF16", 4)
    w = _random_group(56, 96, bits, seed=bits)
    layer = PackedLinear(w)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want = x.double() @ w.dequantize().double().t()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 56)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < TOL[dtype], err
    assert torch.equal(layer.rows(torch.tensor([55, 0, 17, 17]), torch.float32),
                       w.dequantize()[[55, 0, 17, 17]])


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 32), (4, 16), (8, 16)])
@pytest.mark.parametrize("rows", [8, 9, 17, 32])
def test_dot_product_rows_equal_dequantize_then_matmul(bits, group, rows):
    """8 or more bfloat16 rows through the row operator: on a CPU with AVX512-BF16 each
    tile's strip is decoded to bfloat16 once and multiplied with VDPBF16PS (full blocks of
    8 rows and a remainder), elsewhere the float32 row path; both within the bfloat16
    tolerance of dequantize-then-matmul."""
    w = _random_group(56, 96, bits, seed=bits).regrouped(group)
    layer = PackedLinear(w)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = torch.ops.raylm_quant.linear(x, layer.codes, layer.scales, 56, bits, group)
    want = x.double() @ w.dequantize().double().t()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 56)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < TOL[torch.bfloat16], err


def test_packed_weight_is_smaller_than_float32():
    w = _random_group(256, 512, 4)
    assert PackedLinear(w).nbytes() == 256 * 512 // 2 + 256 * 16 * 2 * 4  # 6 bits a weight


# ---- a GGUF file, kept quantized -------------------------------------------------------------

@pytest.fixture(scope="module")
def q4_gguf(llama_path, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gguf-q4")
    return write_gguf_from_hf(llama_path, str(folder / "tiny-llama.Q4_0.gguf"), "Q4_0")


@pytest.fixture(scope="module")
def q5_gguf(llama_path, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gguf-q5")
    return write_gguf_from_hf(llama_path, str(folder / "tiny-llama.Q5_1.gguf"), "Q5_1")


def _ctx(tp_rank: int, tp_size: int) -> ParallelContext:
    # Loading only: a stand-in group object (no collective runs while building or loading).
    return ParallelContext(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, dp_rank=0,
                           device=torch.device("cpu"),
                           tp_group=object() if tp_size > 1 else None, pp_group=None)


def _quantized_layers(model) -> dict[str, QuantizableWeight]:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, QuantizableWeight) and m.quantized is not None}


def test_each_tp_rank_keeps_its_slice_quantized(q4_gguf):
    """TP=2: every linear, the embedding and the LM head run quantized, each rank's packed
    weight decodes to its slice of the whole dequantized weight, and each rank reads half
    of every quantized tensor's bytes from the file (the norms whole)."""
    from gguf import GGUFReader

    from raylm.runner.loading.model_loader import WeightReadStats

    tensors = GGUFReader(q4_gguf).tensors
    quantized_bytes = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == "Q4_0")
    norm_bytes = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == "F32")
    config = dict(model=q4_gguf, dtype="float32", hf_config=read_gguf_config(q4_gguf))
    whole = get_model(ModelConfig(**config, quantization="none"), _ctx(0, 1))
    assert not _quantized_layers(whole)
    dense = dict(whole.named_parameters())
    for rank in (0, 1):
        stats = WeightReadStats()
        model = get_model(ModelConfig(**config), _ctx(rank, 2), stats)
        assert stats.bytes_read == quantized_bytes // 2 + norm_bytes
        layers = _quantized_layers(model)
        assert len(layers) == 2 * 4 + 2  # qkv, o, gate_up, down per layer; embedding; head
        for name, layer in layers.items():
            full = dense[f"{name}.weight"]
            got = layer.quantized.dequantize()
            if name.endswith(("o_proj", "down_proj")):  # row parallel: input features
                want = full.chunk(2, dim=1)[rank]
            elif name.endswith("qkv_proj"):
                q, k, v = full.split([64, 32, 32])
                want = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
            elif name.endswith("gate_up_proj"):
                gate, up = full.chunk(2)
                want = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
            else:  # vocabulary-parallel embedding and LM head
                want = full.chunk(2)[rank]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("file, async_scheduling, bits", [
    ("q4_gguf", False, 4), ("q4_gguf", True, 4), ("q5_gguf", True, 8)],
    ids=["q4-sync", "q4-async", "q5-async"])
def test_a_gguf_file_runs_quantized_equal_to_transformers_on_it(request, hf_oracle, file,
                                                                async_scheduling, bits):
    """Q4_0 in the kernel's 4-bit form, Q5_1 in its 8-bit form."""
    path = request.getfixturevalue(file)
    llm = LLM(os.path.dirname(path), async_scheduling=async_scheduling, block_size=8,
              max_num_batched_tokens=16)  # the 37-token prompt prefills in chunks
    try:
        model = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
        layers = _quantized_layers(model)
        assert len(layers) == 2 * 4 + 2
        assert {layer.quantized.bits for layer in layers.values()} == {bits}
        prompts = [[5, 17, 99, 260, 3], list(range(3, 40)), [42]]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        oracle = hf_oracle(path)
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(p, 12)
    finally:
        llm.shutdown()


def test_quantization_names_a_bad_value(q4_gguf):
    config = read_gguf_config(q4_gguf)
    with pytest.raises(ValueError, match="quantization must be one of.*got 'fp8'"):
        ModelConfig(model=q4_gguf, hf_config=config, quantization="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        ModelConfig(model=q4_gguf, hf_config=config, quantization="awq")


@pytest.mark.parametrize("second, quantized", [("4-bit", True), ("8-bit", True),
                                               ("dense", False)])
def test_a_merged_weight_runs_quantized_unless_a_part_is_dense(second, quantized):
    """gate 4-bit with up 4-bit runs quantized; with up 8-bit (a Q4_K_M-style mix) too, both
    as 8-bit codes, the same weight exactly; with up dense the layer runs dense, its weight
    the parts dequantized."""
    from raylm.parallel.layers import MergedColumnParallelLinear
    from raylm.runner.quantization.quantize_model import pack_quantized_weights

    gate = _random_group(32, 64, 4, seed=1)
    up = {"4-bit": _random_group(32, 64, 4, seed=2), "8-bit": _random_group(32, 64, 8, seed=3),
          "dense": _random_group(32, 64, 4, seed=4).dequantize()}[second]
    layer = MergedColumnParallelLinear(64, [32, 32], False, ctx=_ctx(0, 1),
                                       params_dtype=torch.float32)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    pack_quantized_weights(layer)
    want = torch.cat([gate.dequantize(), up if isinstance(up, torch.Tensor) else up.dequantize()])
    assert (layer.quantized is not None) == quantized
    got = layer.quantized.dequantize() if quantized else layer.weight
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if quantized:
        assert layer.quantized.bits == (4 if second == "4-bit" else 8)
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(layer.quantized(x), x @ want.t(), rtol=1e-5, atol=1e-5)
