"""FP8 checkpoints kept one byte a weight: the C++ kernel (fused and decode-then-matmul paths)
and the Triton kernel (interpreted) against dequantize-then-matmul; every e4m3 byte decoded
exactly; tiny random Llama checkpoints written by the test in each layout raylm reads
(FineGrainedFP8 block-wise [128, 128] and per-tensor, vLLM's fp8 per-tensor with static
input scales, compressed-tensors per-channel, per-tensor and block) load through the real
loader kept FP8, say so in the startup log, and their greedy tokens equal transformers' on
the same weights dequantized; what raylm cannot run is refused by the field's name.

Tolerances (of the largest |reference| entry): float32 rows 2e-6 (float32 accumulation in
another order), bfloat16 rows 8e-3 (the output rounded to bfloat16)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from raylm import LLM, SamplingParams  # noqa: E402
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint  # noqa: E402
from raylm.runner.quantization import fp8_linear  # noqa: E402
from raylm.runner.quantization.fp8_linear import Fp8Linear  # noqa: E402
from raylm.runner.quantization.fp8_weight import Fp8Weight, concat_fp8_rows  # noqa: E402
from raylm.scheduler.config.engine_config import ModelConfig  # noqa: E402

TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def _weight(n: int, k: int, layout: str, seed: int) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=gen) * 60).to(torch.float8_e4m3fn)
    group = {"block": 128, "channel": k, "tensor": k}[layout]
    scale = torch.rand(n, -(-k // group), generator=gen) * 0.01 + 1e-3
    if layout == "tensor":
        scale = scale[:1].expand(n, 1).contiguous()
    return Fp8Weight(codes, scale, group)


def test_every_byte_decodes_exactly():
    """All 254 finite e4m3 values (subnormals, both zeros, +-448) through the kernel's decode."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)  # the two NaNs left out
    codes = torch.cat([codes, codes.new_zeros(2, 1)], dim=1)  # K = 128
    w = Fp8Weight(codes.view(torch.float8_e4m3fn), torch.full((2, 1), 0.5), 128)
    layer = Fp8Linear(w)
    assert torch.equal(layer.dequantize(), w.dequantize())
    eye = torch.eye(128)
    assert torch.equal(layer(eye[:8]).t(), w.dequantize()[:, :8])  # fused path, one 1 per row
    assert float(w.dequantize().abs().max()) == FP8_MAX * 0.5


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_kernel_paths_equal_dequantize_then_matmul(layout, dtype, rows, monkeypatch):
    """N=56 (a partial tile of 16), K=300 (blocks of 128, the last partial); 1 and 3 rows
    fused, 40 decode-then-matmul."""
    monkeypatch.setattr(fp8_linear, "FUSED_MAX_ROWS", 4)
    w = _weight(56, 300, layout, seed=rows)
    layer = Fp8Linear(w)
    x = torch.randn(rows, 300, generator=torch.Generator().manual_seed(7)).to(dtype)
    want = x.double() @ w.dequantize().double().t()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 56)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < TOL[dtype], err
    assert torch.equal(layer.rows(torch.tensor([55, 0, 17]), torch.float32),
                       w.dequantize()[[55, 0, 17]])
    assert layer.nbytes() == 64 * 300 + 64 * w.scale.shape[1] * 4  # one byte a weight


def test_narrowing_and_merging_keep_the_values():
    w = _weight(40, 384, "block", seed=1)
    assert torch.equal(w.narrow(1, 128, 256).dequantize(), w.dequantize()[:, 128:])
    assert torch.equal(w.narrow(0, 3, 9).dequantize(), w.dequantize()[3:12])
    with pytest.raises(ValueError, match=r"groups of 128; columns \[64, 192\)"):
        w.narrow(1, 64, 128)
    c = _weight(24, 384, "channel", seed=2)
    assert torch.equal(c.narrow(1, 64, 128).dequantize(), c.dequantize()[:, 64:192])
    merged = concat_fp8_rows([w, c])
    assert merged.group == 128 and merged.scale.shape == (64, 3)
    assert torch.equal(merged.dequantize(), torch.cat([w.dequantize(), c.dequantize()]))


@pytest.mark.parametrize("rows", [1, 17])
def test_triton_kernel_equals_dequantize_then_matmul(rows):
    import importlib

    from raylm.runner.quantization import triton_fp8_linear

    if type(triton_fp8_linear._fp8_linear_kernel).__name__ != "InterpretedFunction":
        triton_fp8_linear = importlib.reload(triton_fp8_linear)
    w = _weight(40, 300, "block", seed=3)
    layer = triton_fp8_linear.TritonFp8Linear(w, "cpu")
    x = torch.randn(rows, 300, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ w.dequantize().double().t()
    err = (layer(x).double() - want).abs().max() / want.abs().max()
    assert err < TOL[torch.float32], err
    assert torch.equal(layer.dequantize(), w.dequantize())


# ---- checkpoints -------------------------------------------------------------------------

def _quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn codes, the checkpoint's scale, the weight they decode to)."""
    n, k = w.shape
    if layout == "block":  # [ceil(N/128), ceil(K/128)]
        pad = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
        pad[:n, :k] = w
        amax = pad.reshape(pad.shape[0] // 128, 128, -1, 128).abs().amax(dim=(1, 3))
        scale = amax.clamp(min=1e-6) / FP8_MAX
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    elif layout == "channel":  # [N, 1]
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / FP8_MAX
        full = scale.expand(n, k)
    else:  # a scalar
        scale = w.abs().amax().clamp(min=1e-6) / FP8_MAX
        full = scale.expand(n, k)
    codes = (w / full).to(torch.float8_e4m3fn)
    return codes, scale.float(), codes.float() * full


# name: (quantization_config, scale key, layout, an input scale key or None)
LAYOUTS = {
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, "weight_scale_inv", "block", None),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"},
                   "weight_scale_inv", "tensor", "activation_scale"),
    "vllm-fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"},
                        "weight_scale", "tensor", "input_scale"),
    "ct-channel": ("channel", "weight_scale", "channel", None),
    "ct-tensor": ("tensor", "weight_scale", "tensor", "input_scale"),
    "ct-block": ("block", "weight_scale", "block", None),
}


def _ct_config(strategy: str) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "dynamic": False, "group_size": None,
               "block_structure": [128, 128] if strategy == "block" else None}
    inputs = ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
               "dynamic": strategy != "tensor"})
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs}}}


def _write(base: str, root: str, name: str) -> tuple[str, str]:
    """(FP8 folder, dense folder of the weights it decodes to)."""
    qc, scale_key, layout, input_key = LAYOUTS[name]
    if isinstance(qc, str):
        qc = _ct_config(qc)
    tensors = load_file(os.path.join(base, "model.safetensors"))
    quantized, dense = {}, {}
    for key, w in tensors.items():
        prefix = key.rpartition(".")[0]
        if key.endswith(".weight") and prefix.split(".")[-1] in LINEARS:
            codes, scale, deq = _quantize(w.float(), layout)
            quantized[key], quantized[f"{prefix}.{scale_key}"] = codes, scale
            if input_key:
                quantized[f"{prefix}.{input_key}"] = torch.tensor(0.02)
            dense[key] = deq
        else:
            quantized[key] = dense[key] = w
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    folders = []
    for kind, state in (("q", quantized), ("dense", dense)):
        folder = os.path.join(root, f"{name}-{kind}")
        shutil.copytree(base, folder)
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(folder, "model.safetensors"))
        if kind == "q":
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump({**config, "quantization_config": qc}, f)
        folders.append(folder)
    return folders[0], folders[1]


@pytest.fixture(scope="module")
def base_llama(tmp_path_factory) -> str:
    """hidden 192: q/o/gate/up rows and columns cut a block of 128 (k/v: 64 rows)."""
    spec = CheckpointSpec(hidden_size=192, intermediate_size=320, num_attention_heads=4,
                          num_key_value_heads=2, seed=17)
    return write_random_checkpoint(str(tmp_path_factory.mktemp("fp8-base")), spec)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpoint_runs_fp8_equal_to_transformers_on_its_weights(name, base_llama, tmp_path,
                                                                 hf_oracle, caplog):
    quantized, dense = _write(base_llama, str(tmp_path), name)
    with caplog.at_level(logging.INFO, logger="raylm.runner.quantization.quantize_model"):
        llm = LLM(quantized, block_size=8, max_num_batched_tokens=16)  # chunks of prefill
    try:
        log = " ".join(r.getMessage() for r in caplog.records)
        assert "8 x FP8 8-bit kernel" in log and "dense" not in log, log  # 4 linears x 2
        model = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
        want = load_file(os.path.join(dense, "model.safetensors"))
        layers = {n: m for n, m in model.named_modules()
                  if getattr(m, "quantized", None) is not None}
        assert len(layers) == 8
        qkv = layers["model.layers.0.self_attn.qkv_proj"].quantized
        assert qkv.codes.dtype == torch.uint8  # one byte a weight
        ref = torch.cat([want[f"model.layers.0.self_attn.{p}.weight"]
                         for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(qkv.dequantize(), ref)
        x = torch.randn(3, 192, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(qkv(x).double(), x.double() @ ref.double().t(), rtol=0,
                                   atol=2e-6 * float((x @ ref.t()).abs().max()))
        prompts = [[5, 17, 99, 260, 3], list(range(3, 40))]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        oracle = hf_oracle(dense)
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(p, 10)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("change, match", [
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
    ({"quant_method": "fp8", "activation_scheme": "tensorwise"}, "activation_scheme="),
    ({"format": "pack-quantized"}, "format='pack-quantized'"),
    ({"weights": {"strategy": "group"}}, "weights.strategy='group'"),
    ({"weights": {"num_bits": 4}}, "weights.num_bits=4"),
    ({"weights": {"type": "int"}}, "weights.type='int'"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme="),
])
def test_what_raylm_cannot_run_is_refused_by_name(base_llama, change, match):
    with open(os.path.join(base_llama, "config.json")) as f:
        config = json.load(f)
    if change.get("quant_method") == "fp8":
        qc = {"activation_scheme": "dynamic", **change}
    else:
        qc = _ct_config("channel")
        weights = change.pop("weights", None)
        if weights:
            qc["config_groups"]["group_0"]["weights"].update(weights)
        qc.update(change)
    with pytest.raises(ValueError, match=match):
        ModelConfig(model=base_llama, hf_config={**config, "quantization_config": qc})


def test_a_weight_without_its_scale_is_refused(base_llama, tmp_path):
    from raylm.runner.quantization.fp8_checkpoint import combine_fp8_linears

    quantized, _ = _write(base_llama, str(tmp_path), "fp8-block")
    state = load_file(os.path.join(quantized, "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight_scale_inv"]
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    with pytest.raises(ValueError, match=r"without scales: \['model.layers.1.mlp.down_proj'\]"):
        list(combine_fp8_linears(sorted(state.items()), config))


def test_tp_ranks_keep_their_slices_and_none_dequantizes(base_llama, tmp_path):
    """Per-channel scales, TP=2: each rank's packed o_proj / down_proj (row parallel: half
    the input features) and gate_up (column parallel) decode to its slice of the dense
    weight; quantization="none" loads the same weights dequantized, nothing kept FP8."""
    from test_quantized_linear import _ctx

    from raylm.runner.loading.model_loader import get_model

    quantized, dense = _write(base_llama, str(tmp_path), "ct-channel")
    want = load_file(os.path.join(dense, "model.safetensors"))
    config = ModelConfig(model=quantized, dtype="float32")
    for rank in (0, 1):
        layers = dict(get_model(config, _ctx(rank, 2)).named_modules())
        o = layers["model.layers.1.self_attn.o_proj"].quantized
        assert torch.equal(o.dequantize(),
                           want["model.layers.1.self_attn.o_proj.weight"].chunk(2, dim=1)[rank])
        down = layers["model.layers.0.mlp.down_proj"].quantized
        assert torch.equal(down.dequantize(),
                           want["model.layers.0.mlp.down_proj.weight"].chunk(2, dim=1)[rank])
        gate_up = layers["model.layers.0.mlp.gate_up_proj"].quantized
        assert torch.equal(gate_up.dequantize(), torch.cat(
            [want[f"model.layers.0.mlp.{p}_proj.weight"].chunk(2)[rank] for p in ("gate", "up")]))
    model = get_model(ModelConfig(model=quantized, dtype="float32", quantization="none"),
                      _ctx(0, 1))
    assert not [m for m in model.modules() if getattr(m, "quantized", None) is not None]
    params = dict(model.named_parameters())
    assert torch.equal(params["model.layers.0.mlp.down_proj.weight"],
                       want["model.layers.0.mlp.down_proj.weight"])


def test_a_checkpoint_on_the_triton_kernel_equals_transformers(base_llama, tmp_path, hf_oracle,
                                                                monkeypatch):
    """Block-wise FP8 run by the Triton kernel (interpreted on CPU)."""
    import importlib

    from raylm.runner.quantization import triton_fp8_linear

    if type(triton_fp8_linear._fp8_linear_kernel).__name__ != "InterpretedFunction":
        importlib.reload(triton_fp8_linear)
    monkeypatch.setenv("RAYLM_QUANT_BACKEND", "triton")
    quantized, dense = _write(base_llama, str(tmp_path), "fp8-block")
    llm = LLM(quantized, block_size=8, max_num_batched_tokens=16)
    try:
        model = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
        kernels = {type(m.quantized).__name__ for m in model.modules()
                   if getattr(m, "quantized", None) is not None}
        assert kernels == {"TritonFp8Linear"}
        prompt = [5, 17, 99, 260, 3]  # short: the interpreter runs every linear
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_oracle(dense).greedy(prompt, 4)
    finally:
        llm.shutdown()
