"""The LoRA products of one adapted linear against a per-token float64 reference: the torch
path's two plans (one matmul pair per segment; one batched matmul over padded segments)
and the Triton kernels run on CPU by Triton's interpreter (small shapes, float32 and
bfloat16), with padding rows, tokens of one adapter spread over the batch, fused slices
(q/k/v), rank padding; the fixed buffers a CUDA graph replays over; and the TP cuts of
the slots (column- and row-parallel, KV heads replicated over ranks)."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from raylm.parallel.context import ParallelContext  # noqa: E402
from raylm.parallel.layers import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from raylm.runner.lora import triton_ops  # noqa: E402
from raylm.runner.lora.lora_linear import LoRAContext, LoRALinear  # noqa: E402
from raylm.runner.lora.mapping import LoRAMapping, TritonBuffers, torch_segments  # noqa: E402

if type(triton_ops._shrink_kernel).__name__ != "InterpretedFunction":
    triton_ops = importlib.reload(triton_ops)  # imported earlier without the interpreter


def _qkv(dtype=torch.float32, ctx=None) -> QKVParallelLinear:
    layer = QKVParallelLinear(32, 8, 4, 2, False, ctx=ctx or ParallelContext.single(),
                              params_dtype=dtype)
    torch.nn.init.normal_(layer.weight)
    return layer


def _adapters(layer: LoRALinear, ranks: list[int], seed: int = 0):
    """One adapter per rank: a list of (A, B) per slice (whole, float32)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in ranks:
        parts = []
        for _, size in layer.slices:
            parts.append((torch.randn(r, layer.base.weight.shape[1], generator=gen),
                          torch.randn(size, r, generator=gen)))
        out.append(parts)
    return out


def _load(hook: LoRALinear, adapters) -> None:
    for slot, parts in enumerate(adapters):
        hook.write_slot(slot, [hook.shard(i, a, b) for i, (a, b) in enumerate(parts)])


def _reference(x, adapters, token_slots, slices) -> torch.Tensor:
    out = torch.zeros(x.shape[0], sum(s for _, s in slices), dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for (start, size), (a, b) in zip(slices, adapters[slot], strict=True):
            out[t, start:start + size] = (x[t].double() @ a.double().T) @ b.double().T
    return out


# Tokens: adapter 1 in a prefill run and a later decode, adapter 0 spread, padding rows.
SLOTS = np.array([1, 1, 1, 1, 1, -1, 0, 2, -1, 0, 1, 2, 0, -1, -1, -1], np.int64)


@pytest.mark.parametrize("token_slots", [
    pytest.param(SLOTS, id="mixed"),
    pytest.param(np.array([2] * 5 + [-1] * 3, np.int64), id="one-adapter-slice"),
    pytest.param(np.array([0, 1, 0, 1, 2, 2], np.int64), id="bmm-no-padding"),
    pytest.param(np.array([0] * 9 + [1, 2], np.int64), id="long-and-short-loop"),
])
def test_torch_plans_match_reference(token_slots):
    ctx = LoRAContext("torch")
    hook = LoRALinear(_qkv(), num_slots=3, rank=8, context=ctx)
    adapters = _adapters(hook, [8, 3, 5])
    _load(hook, adapters)
    x = torch.randn(token_slots.size, 32)
    seg = torch_segments(token_slots, torch.device("cpu"))
    ctx.mapping = LoRAMapping(token_slots.size, True, torch_segments=seg)
    out = torch.zeros(token_slots.size, hook.out_features)
    hook.apply(x, out)
    want = _reference(x, adapters, token_slots, hook.slices)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


def test_plan_choice():
    cpu = torch.device("cpu")
    assert torch_segments(np.array([-1, -1]), cpu) is None
    assert torch_segments(np.array([0, 1, 0, 1]), cpu).shape == (2, 2)  # bmm, no padding
    loop = torch_segments(np.array([3, 3, 3, -1, 3]), cpu).loop  # one adapter: a loop
    assert loop[0][0] == 3 and isinstance(loop[0][1], torch.Tensor)  # not contiguous
    assert torch_segments(np.array([-1, 3, 3]), cpu).loop == [(3, slice(1, 3))]
    assert torch_segments(np.array([0] * 9 + [1, 2]), cpu).loop is not None  # padding 2x+


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_torch(dtype):
    x = torch.randn(SLOTS.size, 32).to(dtype)
    outs = {}
    for backend in ("torch", "triton"):
        ctx = LoRAContext(backend)
        rank = 8 if backend == "torch" else triton_ops.padded_rank(8)
        hook = LoRALinear(_qkv(dtype), num_slots=3, rank=rank, context=ctx)
        torch.manual_seed(1)
        hook.base.weight.data.normal_()
        _load(hook, _adapters(hook, [8, 3, 5]))
        if backend == "torch":
            ctx.mapping = LoRAMapping(SLOTS.size, True,
                                      torch_segments=torch_segments(SLOTS, torch.device("cpu")))
        else:
            buffers = TritonBuffers(32, 3, torch.device("cpu"))
            assert buffers.fill(SLOTS)
            ctx.mapping = LoRAMapping(SLOTS.size, True, buffers=buffers)
        base = torch.randn(SLOTS.size, hook.out_features, generator=torch.Generator().manual_seed(2))
        out = base.to(dtype)
        hook.apply(x, out)
        outs[backend] = out.float()
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=tol, rtol=tol)


def test_triton_reads_everything_from_the_fixed_buffers():
    """What a CUDA graph relies on: the kernels launched over the buffers' views give each
    step's products from whatever the step wrote there, and nothing without adapters."""
    ctx = LoRAContext("triton")
    hook = LoRALinear(_qkv(), num_slots=3, rank=16, context=ctx)
    adapters = _adapters(hook, [8, 3, 5])
    _load(hook, adapters)
    buffers = TritonBuffers(16, 3, torch.device("cpu"))
    ctx.mapping = LoRAMapping(8, True, buffers=buffers)  # the "captured" launch
    x = torch.randn(8, 32)
    for token_slots in (np.array([2, -1, 0, 0, 1, -1, -1, -1]), np.full(8, -1),
                        np.array([1, 1, 1, 1, 1, 1, 1, 1])):
        buffers.fill(token_slots)
        out = torch.zeros(8, hook.out_features)
        hook.apply(x, out)
        want = _reference(x, adapters, token_slots, hook.slices)
        torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


def _tp_ctx(rank: int) -> ParallelContext:
    return ParallelContext(tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0,
                           device=torch.device("cpu"), tp_group=object())


@pytest.mark.parametrize("make", [
    pytest.param(lambda ctx: QKVParallelLinear(32, 8, 4, 1, False, ctx=ctx,
                                               params_dtype=torch.float32), id="qkv-kv-replicated"),
    pytest.param(lambda ctx: QKVParallelLinear(32, 8, 4, 2, False, ctx=ctx,
                                               params_dtype=torch.float32), id="qkv"),
    pytest.param(lambda ctx: MergedColumnParallelLinear(32, [24, 24], False, ctx=ctx,
                                                        params_dtype=torch.float32), id="gate-up"),
    pytest.param(lambda ctx: RowParallelLinear(48, 32, False, ctx=ctx,
                                               params_dtype=torch.float32), id="down"),
])
def test_tp_shards_add_up_to_the_whole_product(make):
    """Each rank's slots give its columns of a column-parallel product; the row-parallel
    ranks' partial products sum (the all-reduce) to the whole."""
    whole = LoRALinear(make(ParallelContext.single()), 1, 8, LoRAContext("torch"))
    gen = torch.Generator().manual_seed(3)
    fan_in = 48 if isinstance(whole.base, RowParallelLinear) else 32
    full = [(torch.randn(6, fan_in, generator=gen), torch.randn(size, 6, generator=gen))
            for _, size in whole.slices]
    x = torch.randn(5, fan_in, generator=gen)
    parts = []
    for rank in range(2):
        ctx = LoRAContext("torch")
        hook = LoRALinear(make(_tp_ctx(rank)), 1, 8, ctx)
        hook.write_slot(0, [hook.shard(i, a, b) for i, (a, b) in enumerate(full)])
        ctx.mapping = LoRAMapping(5, True, torch_segments=torch_segments(
            np.zeros(5, np.int64), torch.device("cpu")))
        out = torch.zeros(5, hook.out_features)
        x_rank = x if not isinstance(hook.base, RowParallelLinear) else x[:, rank * 24:(rank + 1) * 24]
        hook.apply(x_rank, out)
        parts.append((hook, out))
    if isinstance(whole.base, RowParallelLinear):
        got = parts[0][1] + parts[1][1]
        torch.testing.assert_close(got, (x @ full[0][0].T) @ full[0][1].T, atol=1e-4, rtol=1e-4)
        return
    for s, (a, b) in enumerate(full):
        want = (x @ a.T) @ b.T
        for rank, (hook, out) in enumerate(parts):
            replicas = getattr(hook.base, "num_kv_head_replicas", 1) if s else 1
            start, size = hook.slices[s]
            shard = rank // replicas
            torch.testing.assert_close(out[:, start:start + size],
                                       want[:, shard * size:(shard + 1) * size],
                                       atol=1e-4, rtol=1e-4)
