"""GPTQ and AWQ checkpoints (4-bit, group 128) written by the test in each format's real
layout from a random Llama, GPTQ also in act order (desc_act: groups of scattered input
features): raylm loads them kept quantized and its greedy tokens equal transformers' on
the same weights dequantized (a dense folder the test writes beside); the act-order
linear against its dequantized weight, whole and as a row-parallel rank's slice; what
raylm cannot run is refused by name."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from raylm import LLM, SamplingParams
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.scheduler.config.engine_config import ModelConfig

GROUP = 128
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _quantize(w: torch.Tensor, symmetric: bool, perm: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, ...]:
    """w [N, K] -> codes [N, K], zeros [K/G, N], float16 scales [K/G, N], and the weight
    they decode to. ``perm`` (act order): group j holds features perm[jG:(j+1)G]."""
    if perm is not None:  # quantize in perm's order, then put the columns back
        codes, zero, scale, deq = _quantize(w[:, perm], symmetric)
        inverse = torch.argsort(perm)
        return codes[:, inverse], zero, scale, deq[:, inverse]
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-4).half()
        zero = torch.full_like(scale, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-4).half()
        zero = (-lo / scale.float()).round().clamp(0, 15).long()
    codes = (g / scale.float().unsqueeze(-1)).round().long() + zero.unsqueeze(-1)
    codes = codes.clamp(0, 15)
    deq = (scale.float().unsqueeze(-1) * (codes - zero.unsqueeze(-1))).reshape(n, k)
    return codes.reshape(n, k), zero.t(), scale.t(), deq


def _pack(values: np.ndarray, axis: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values along ``axis`` per int32, value order[j] of each eight in bits 4j."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    packed = np.zeros(v.shape[:-1], dtype=np.uint32)
    for j in range(8):
        packed |= (v[..., j] & 15) << (4 * j)
    return torch.from_numpy(np.moveaxis(packed, -1, axis).view(np.int32).copy())


def _write(base: str, root: str, method: str, act_order: bool = False) -> tuple[str, str]:
    """(quantized folder, dense folder of the weights it decodes to). ``act_order`` (GPTQ's
    desc_act): each linear's groups are random sets of input features, named by g_idx."""
    tensors = load_file(os.path.join(base, "model.safetensors"))
    quantized, dense = {}, {}
    gen = torch.Generator().manual_seed(5)
    for name, w in tensors.items():
        prefix, _, _ = name.rpartition(".")
        if name.endswith(".weight") and prefix.split(".")[-1] in LINEARS:
            k = w.shape[1]
            perm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
            codes, zero, scale, deq = _quantize(w.float(), symmetric=method == "gptq",
                                                perm=perm if act_order else None)
            dense[name] = deq
            if method == "gptq":  # v1: zeros stored minus one; g_idx: each feature's group
                quantized[f"{prefix}.qweight"] = _pack(codes.t().numpy(), axis=0)
                quantized[f"{prefix}.qzeros"] = _pack((zero - 1).numpy(), axis=1)
                quantized[f"{prefix}.g_idx"] = (torch.argsort(perm) // GROUP).int()
            else:
                quantized[f"{prefix}.qweight"] = _pack(codes.t().numpy(), 1, AWQ_ORDER)
                quantized[f"{prefix}.qzeros"] = _pack(zero.numpy(), 1, AWQ_ORDER)
            quantized[f"{prefix}.scales"] = scale
        else:
            quantized[name] = dense[name] = w
    folders = []
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    for kind, state in (("q", quantized), ("dense", dense)):
        folder = os.path.join(root, f"{method}-{kind}")
        shutil.copytree(base, folder)
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(folder, "model.safetensors"))
        if kind == "q":
            qc = ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
                   "sym": True, "checkpoint_format": "gptq"} if method == "gptq" else
                  {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                   "version": "gemm"})
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump({**config, "quantization_config": qc}, f)
        folders.append(folder)
    return folders[0], folders[1]


@pytest.fixture(scope="module")
def base_llama(tmp_path_factory) -> str:
    spec = CheckpointSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2, seed=11)
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gptq-base")), spec)


@pytest.mark.parametrize(("method", "act_order"), [("gptq", False), ("awq", False),
                                                  ("gptq", True)],
                         ids=["gptq", "awq", "gptq-act-order"])
def test_checkpoint_runs_quantized_equal_to_transformers_on_its_weights(
        method, act_order, base_llama, tmp_path, hf_oracle):
    quantized, dense = _write(base_llama, str(tmp_path), method, act_order)
    llm = LLM(quantized, async_scheduling=True, block_size=8)
    try:
        model = llm.llm_engine.core.engine_core.executor.worker.model_runner.model
        kinds = {m.quantized.kind for m in model.modules()
                 if getattr(m, "quantized", None) is not None}
        assert kinds == {method.upper()}
        prompts = [[5, 17, 99, 260, 3], list(range(3, 40))]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        oracle = hf_oracle(dense)
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(p, 10)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("change, match", [
    ({"quant_method": "fp8"}, "quant_method='fp8'"),
    ({"bits": 8}, "bits=8"),
    ({"group_size": 48}, "group_size=48"),
])
def test_what_raylm_cannot_run_is_refused_by_name(base_llama, change, match):
    with open(os.path.join(base_llama, "config.json")) as f:
        config = json.load(f)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, **change}
    with pytest.raises(ValueError, match=match):
        ModelConfig(model=base_llama, hf_config={**config, "quantization_config": qc})


@pytest.mark.parametrize("rows", [1, 3, 64], ids=["decode", "few", "dense-path"])
def test_an_act_order_linear_equals_its_dequantized_weight(rows):
    """K = 256 in groups of 128 named by a random g_idx; also a row-parallel rank's slice
    of 96 features (groups split unevenly: each run padded to 32 in the kernel)."""
    from raylm.runner.quantization.act_order import ActOrderQuantized
    from raylm.runner.quantization.packed_linear import PackedLinear

    gen = torch.Generator().manual_seed(9)
    n, k = 48, 256
    g_idx = torch.argsort(torch.randperm(k, generator=gen)) // GROUP
    scale = torch.rand(n, k // GROUP, generator=gen) * 0.1 + 0.01
    weight = ActOrderQuantized(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                               g_idx, scale, -scale * 8)
    x = torch.randn(rows, k, generator=gen)
    for shard, xs in ((weight, x), (weight.narrow(1, 160, 96), x[:, 160:])):
        group = shard.to_group()
        assert group.codes.shape[1] % 32 == 0 and group.codes.shape[1] >= shard.shape[1]
        linear = PackedLinear(group)
        want = xs.double() @ shard.dequantize().double().t()
        torch.testing.assert_close(linear(xs).double(), want, rtol=2e-6, atol=2e-6 * float(
            want.abs().max()))
        torch.testing.assert_close(linear.dequantize(), shard.dequantize())
