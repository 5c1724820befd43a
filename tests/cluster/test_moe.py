"""Qwen3-MoE: the sparse expert MLP (softmax router, top-k renormalised, experts run
grouped by expert) against a per-token reference, and the whole model against
transformers, token for token, sync and async, with chunked prefill, prefix hits and
preemption, dense and sparse layers mixed."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from family_check import assert_greedy_equals_transformers

from raylm import LLM
from raylm.parallel.context import ParallelContext
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.moe import SparseMoeBlock


def _block(num_experts: int, top_k: int, norm: bool) -> SparseMoeBlock:
    torch.manual_seed(num_experts * 10 + top_k)
    block = SparseMoeBlock(16, 12, num_experts, top_k, norm, ParallelContext.single(), torch.float32)
    block.gate.weight.data.normal_()
    for e in range(num_experts):
        block.load_expert_weight(e, "gate_proj", torch.randn(12, 16))
        block.load_expert_weight(e, "up_proj", torch.randn(12, 16))
        block.load_expert_weight(e, "down_proj", torch.randn(16, 12))
    return block


@pytest.mark.parametrize(("num_experts", "top_k", "norm"), [(8, 2, True), (4, 1, False),
                                                            (6, 6, True)])
def test_grouped_experts_equal_a_per_token_reference(num_experts, top_k, norm):
    block = _block(num_experts, top_k, norm)
    x = torch.randn(11, 16)
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, ids = probs[t].topk(top_k)
        if norm:
            w = w / w.sum()
        for weight, e in zip(w.tolist(), ids.tolist(), strict=True):
            gate, up = (block.w13[e] @ x[t]).chunk(2)
            want[t] += weight * (block.w2[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


def test_a_missing_or_unknown_expert_weight_is_named():
    block = SparseMoeBlock(16, 12, 2, 1, True, ParallelContext.single(), torch.float32)
    block.load_expert_weight(0, "gate_proj", torch.randn(12, 16))
    assert block.missing_expert_weights() == [
        "experts.0.up_proj", "experts.0.down_proj", "experts.1.gate_proj",
        "experts.1.up_proj", "experts.1.down_proj"]
    with pytest.raises(ValueError, match="expert 2 out of range"):
        block.load_expert_weight(2, "gate_proj", torch.randn(12, 16))
    with pytest.raises(ValueError, match="expert 0 down_proj: checkpoint shard has shape"):
        block.load_expert_weight(0, "down_proj", torch.randn(12, 16))


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    """3 layers: the middle one dense (mlp_only_layers), 8 experts, top 2."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3moe")), CheckpointSpec(
        architecture="Qwen3MoeForCausalLM", num_hidden_layers=3, head_dim=32,
        mlp_only_layers=(1,), seed=31))


def test_the_sparse_layers_are_those_transformers_builds(moe_path, hf_oracle):
    with open(f"{moe_path}/config.json") as f:
        cfg = DecoderConfig.from_hf(json.load(f))
    assert cfg.moe_layers == (True, False, True) and cfg.num_experts == 8
    hf = hf_oracle(moe_path).model.model.layers
    assert [type(layer.mlp).__name__ for layer in hf] == [
        "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_qwen3_moe_equals_transformers(moe_path, async_scheduling, hf_oracle):
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    prompts = [shared + [7, 8], shared + [rng.randrange(3, 512) for _ in range(25)],
               [rng.randrange(3, 512) for _ in range(33)], [5, 6]]
    assert_greedy_equals_transformers(
        moe_path, hf_oracle(moe_path), prompts, [14, 9, 16, 20],
        async_scheduling=async_scheduling, block_size=4, num_kv_blocks=28,
        max_num_batched_tokens=16, max_num_seqs=4)


def test_lora_on_a_moe_model_is_refused_by_name(moe_path):
    with pytest.raises(ValueError, match="enable_lora is not supported for Qwen3MoeForCausalLM"):
        LLM(moe_path, enable_lora=True)


def test_a_checkpoint_missing_an_expert_is_refused(moe_path, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(moe_path, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.2\.mlp\.w13"):
        LLM(str(broken))
