"""The fused decode layer (runner/models/fused_decode_layer.py): a Llama's decode step on the
CPU, each layer one C++ call, against the eager layers on the same step (the stage's output
and every KV cache write), quantized (a Q4_1 file) and dense (oneDNN's packed weights), in
float32 and bfloat16, with and without a residual coming in; where it does not apply it is
not built; end to end, the decode steps take it and the tokens equal transformers'.

Tolerances: float32 1e-5 of the largest entry (the RMSNorm's sum of squares in another
order); bfloat16 outputs may differ by one rounding where that sum lands a value on the
other side of a bfloat16 step, so at most 1% of entries differ and none by more than 2% of
the largest entry; the KV caches the same."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.parallel.context import ParallelContext
from raylm.runner.attention.paged_attention import allocate_kv_cache, build_attention_metadata
from raylm.runner.loading.gguf_checkpoint import read_gguf_config
from raylm.runner.loading.gguf_writer import write_gguf_from_hf
from raylm.runner.loading.model_loader import get_model
from raylm.runner.models.fused_decode_layer import FusedDecodeLayers
from raylm.scheduler.config.engine_config import ModelConfig

BS, NUM_BLOCKS = 8, 24


@pytest.fixture(scope="module")
def q4_1_gguf(llama_path, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gguf-fused")
    return write_gguf_from_hf(llama_path, str(folder / "tiny-llama.Q4_1.gguf"), "Q4_1")


def _ctx() -> ParallelContext:
    return ParallelContext(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0,
                           device=torch.device("cpu"), tp_group=None, pp_group=None)


def _model(path: str, dtype: str, quantization: str | None = None):
    hf = read_gguf_config(path) if path.endswith(".gguf") else None
    config = ModelConfig(model=path, dtype=dtype, hf_config=hf, quantization=quantization)
    return get_model(config, _ctx()).model


def _bind_caches(model, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        attn = layer.self_attn.attn
        attn.kv_cache = allocate_kv_cache(NUM_BLOCKS, BS, attn.num_kv_heads, attn.head_dim,
                                          dtype, "cpu")
        for c in attn.kv_cache:
            c.copy_(torch.randn(c.shape, generator=gen).to(dtype))


def _decode_step(lens: list[int]):
    """Metadata for one decode token per row, row i having lens[i] keys (its new one
    included), each row in blocks of its own."""
    rng = np.random.default_rng(0)
    free = iter(rng.permutation(NUM_BLOCKS).tolist())
    tables = [[next(free) for _ in range(-(-n // BS))] for n in lens]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([tables[i][(n - 1) // BS] * BS + (n - 1) % BS
                          for i, n in enumerate(lens)])
    qsl = np.arange(len(lens) + 1)
    meta = build_attention_metadata(qsl, np.array(lens), slots, table, BS)
    return meta, torch.tensor([n - 1 for n in lens])


def _caches(model) -> list[torch.Tensor]:
    return [c.clone() for layer in model.layers for c in layer.self_attn.attn.kv_cache]


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str):
    scale = want.float().abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale, msg=what)
        return
    differ = (got != want).float().mean().item()
    worst = (got.float() - want.float()).abs().max().item()
    assert differ <= 0.01 and worst <= 0.02 * scale, (what, differ, worst, scale)


@pytest.mark.parametrize("weights", ["quantized", "dense"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["first-stage", "residual-in"])
def test_a_decode_step_equals_the_eager_layers(q4_1_gguf, llama_path, weights, dtype,
                                               with_residual, caplog):
    torch_dtype = getattr(torch, dtype)
    model = _model(q4_1_gguf if weights == "quantized" else llama_path, dtype)
    with caplog.at_level(logging.INFO, logger="raylm.runner.models.fused_decode_layer"):
        fused = model.fused_decode_layers()
    assert fused is not None and len(fused.layers) == len(model.layers)
    assert f"run each of this stage's {len(model.layers)} layers as one C++ call" \
        in caplog.text
    assert set(fused.layers[0].bits) == ({4} if weights == "quantized" else {0})
    lens = [1, 9, 17, 30]  # a first token, block edges, a longer context
    meta, positions = _decode_step(lens)
    assert fused.applies(meta, torch.empty(len(lens), 64, dtype=torch_dtype))
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(len(lens), 64, generator=gen).to(torch_dtype)
    residual = (torch.randn(len(lens), 64, generator=gen).to(torch_dtype)
                if with_residual else None)
    cos_sin = model.rotary_embs[0].cos_sin(positions)

    outs, caches = [], []
    for run_fused in (False, True):
        _bind_caches(model, torch_dtype, seed=7)
        if run_fused:
            h, r = fused.forward(cos_sin, hidden, residual, meta)
        else:
            h, r = hidden, residual
            for layer in model.layers:
                h, r = layer(cos_sin, h, r, meta)
        outs.append((h, r))
        caches.append(_caches(model))
    (want_h, want_r), (got_h, got_r) = outs
    _assert_close(got_h, want_h, torch_dtype, "hidden")
    _assert_close(got_r, want_r, torch_dtype, "residual")
    for i, (got, want) in enumerate(zip(caches[1], caches[0], strict=True)):
        _assert_close(got, want, torch_dtype, f"cache {i}")
    # The step wrote each row's new key: the caches moved from their random start.
    _bind_caches(model, torch_dtype, seed=7)
    assert not all(torch.equal(a, b) for a, b in zip(_caches(model), caches[1], strict=True))


def test_it_applies_only_where_it_computes_the_layer(q4_1_gguf, llama_path, monkeypatch):
    meta, _ = _decode_step([5, 12])
    model = _model(q4_1_gguf, "float32")
    fused = model.fused_decode_layers()
    assert fused is not None
    assert not fused.applies(meta, torch.empty(2, 64, dtype=torch.bfloat16))  # other dtype
    rows = fused.max_rows + 1  # past the quantized kernel's row path
    assert not fused.applies(meta, torch.empty(rows, 64))
    prefill = build_attention_metadata(np.array([0, 12]), np.array([12]),
                                       torch.arange(12), torch.tensor([[0, 1]]), BS)
    assert not fused.applies(prefill, torch.empty(12, 64))
    # Dense linears take any rows; a dequantized file runs dense.
    dense = _model(q4_1_gguf, "float32", "none").fused_decode_layers()
    assert dense is not None and dense.max_rows > 4096 and set(dense.layers[0].bits) == {0}
    # Dense weights without oneDNN's packing, or switched off: not built.
    monkeypatch.setenv("RAYLM_CPU_PACK_LINEARS", "0")
    assert _model(llama_path, "float32").fused_decode_layers() is None
    monkeypatch.delenv("RAYLM_CPU_PACK_LINEARS")
    monkeypatch.setenv("RAYLM_CPU_DECODE_LAYER", "0")
    assert model.fused_decode_layers() is None


@pytest.mark.parametrize("weights, async_scheduling, ngram", [
    ("quantized", False, False), ("quantized", True, False), ("quantized", True, True),
    ("dense", True, False)], ids=["sync", "async", "async-ngram", "dense-async"])
def test_decode_steps_take_it_and_equal_transformers(q4_1_gguf, llama_path, hf_oracle,
                                                      monkeypatch, weights, async_scheduling,
                                                      ngram):
    """With ngram speculation the verifying steps' rows are several tokens each (a
    repeating prompt makes the lookup propose), still one call per layer."""
    path = q4_1_gguf if weights == "quantized" else llama_path
    calls = []
    forward = FusedDecodeLayers.forward

    def counted(self, cos_sin, hidden, residual, meta):
        calls.append(hidden.shape[0])
        return forward(self, cos_sin, hidden, residual, meta)

    monkeypatch.setattr(FusedDecodeLayers, "forward", counted)
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3} if ngram else None)
    llm = LLM(os.path.dirname(path) if weights == "quantized" else path,
              async_scheduling=async_scheduling, block_size=8,
              max_num_batched_tokens=16, dtype="float32", speculative_config=spec)
    try:
        prompts = [[5, 17, 99, 260, 3], list(range(3, 40)), [42]]
        if ngram:
            prompts.append([11, 12, 13, 14] * 4)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        metrics = llm.get_metrics()
        oracle = hf_oracle(path)
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(p, 12)
    finally:
        llm.shutdown()
    # Every step after the prefills decodes: 11 more tokens for the last request to finish.
    assert len(calls) >= (3 if ngram else 11), calls
    if ngram:  # drafts verified: some step ran more rows than requests
        assert metrics["raylm:spec_decode_num_draft_tokens"] > 0
        assert max(calls) > len(prompts), calls
    else:
        assert max(calls) == 3, calls
