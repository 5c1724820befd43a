"""The Triton sparse expert MLP (runner/models/fused_moe_triton.py) on CPU under Triton's
interpreter against the torch grouped path of SparseMoeBlock: small shapes, float32 and
bfloat16, experts with no tokens, one expert taking every slot, and a rank holding only
some experts (expert parallelism: the others' slots contribute nothing here)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from raylm.parallel.context import ParallelContext  # noqa: E402
from raylm.runner.models import fused_moe_triton  # noqa: E402
from raylm.runner.models.moe import SparseMoeBlock  # noqa: E402

if type(fused_moe_triton._gate_up_kernel).__name__ != "InterpretedFunction":
    fused_moe_triton = importlib.reload(fused_moe_triton)  # imported without the interpreter


def _block(num_experts: int, top_k: int, hidden: int, inter: int, dtype) -> SparseMoeBlock:
    torch.manual_seed(num_experts + top_k + hidden)
    block = SparseMoeBlock(hidden, inter, num_experts, top_k, True, ParallelContext.single(),
                           dtype)
    block.gate.weight.data.normal_()
    block.w13.data.normal_(std=0.2)
    block.w2.data.normal_(std=0.2)
    return block


def _routing(block: SparseMoeBlock, x: torch.Tensor, experts: torch.Tensor | None = None):
    probs = torch.softmax(block.gate(x).float(), dim=-1)
    weights, chosen = probs.topk(block.top_k, dim=-1)
    if experts is not None:
        chosen = experts
    return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), chosen


@pytest.mark.parametrize(("num_experts", "top_k", "hidden", "inter", "tokens"), [
    (4, 2, 32, 16, 5), (8, 2, 48, 24, 37), (6, 3, 64, 80, 1), (3, 1, 16, 16, 20)])
def test_fused_experts_equal_the_torch_path(num_experts, top_k, hidden, inter, tokens):
    block = _block(num_experts, top_k, hidden, inter, torch.float32)
    x = torch.randn(tokens, hidden)
    weights, experts = _routing(block, x)
    want = block._run_local_experts(x, weights, experts)
    got = fused_moe_triton.fused_experts(x, block.w13, block.w2, weights, experts, 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_every_slot_on_one_expert_and_others_idle():
    block = _block(4, 2, 32, 16, torch.float32)
    x = torch.randn(19, 32)
    weights, _ = _routing(block, x)
    experts = torch.tensor([[2, 3]] * 19)  # experts 0 and 1 get nothing
    want = block._run_local_experts(x, weights, experts)
    got = fused_moe_triton.fused_experts(x, block.w13, block.w2, weights, experts, 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_rank_holding_some_experts_adds_only_theirs():
    """Experts 2 and 3 of 4 on this rank: a slot routed to 0 or 1 adds nothing."""
    full = _block(4, 2, 32, 16, torch.float32)
    x = torch.randn(13, 32)
    weights, experts = _routing(full, x)
    mine = weights * (experts >= 2)
    want = full._run_local_experts(x, mine, experts)
    got = fused_moe_triton.fused_experts(x, full.w13[2:], full.w2[2:], weights, experts, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bfloat16_close_to_the_float32_torch_path():
    block = _block(4, 2, 32, 16, torch.float32)
    x = torch.randn(9, 32)
    weights, experts = _routing(block, x)
    want = block._run_local_experts(x, weights, experts)
    got = fused_moe_triton.fused_experts(x.bfloat16(), block.w13.bfloat16(),
                                         block.w2.bfloat16(), weights.bfloat16(), experts, 0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_no_tokens():
    block = _block(4, 2, 32, 16, torch.float32)
    x = torch.empty(0, 32)
    weights, experts = _routing(block, x)
    assert fused_moe_triton.fused_experts(x, block.w13, block.w2, weights, experts,
                                          0).shape == (0, 32)
