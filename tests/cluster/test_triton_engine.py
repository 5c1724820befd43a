"""The whole engine on the Triton attention kernel (the CUDA path), run on CPU by Triton's
interpreter: greedy tokens equal transformers through chunked prefill, a prefix-cache hit
and preemption, sync and async; and the draft model's forwards take the same kernel."""

from __future__ import annotations

import importlib
import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from test_llm_correctness import ASYNC_MODES, _assert_no_leak, _check_against_hf, _prompts  # noqa: E402

from raylm import LLM  # noqa: E402
from raylm.runner.attention import triton_paged  # noqa: E402

if type(triton_paged._paged_attention_kernel).__name__ != "InterpretedFunction":
    importlib.reload(triton_paged)  # imported earlier without the interpreter


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("RAYLM_ATTENTION_BACKEND", "triton")
    calls = {"attention": 0}
    real = triton_paged.paged_attention

    def counted(*args, **kwargs):
        calls["attention"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_paged, "paged_attention", counted)
    return calls


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_chunks_prefix_hits_and_preemption_equal_hf(llama_path, hf_oracle, async_scheduling,
                                                    triton_backend):
    # 16-token blocks (the kernel's smallest), a 24-token budget that chunks every long
    # prompt, and 12 blocks: too few for all six requests at full length.
    llm = LLM(llama_path, async_scheduling=async_scheduling, block_size=16, num_kv_blocks=12,
              max_num_batched_tokens=24, max_num_seqs=6)
    vocab = llm.llm_engine.model_config.vocab_size
    shared = _prompts(vocab, [32], seed=7)[0]
    prompts = [shared + p for p in _prompts(vocab, [3, 14], seed=1)]
    prompts += _prompts(vocab, [41, 6, 25, 1], seed=2)
    _check_against_hf(llm, hf_oracle(llama_path), prompts, [24, 30, 28, 20, 32, 9])
    m = llm.get_metrics()
    assert m["raylm:num_preemptions"] > 0, m
    assert m["raylm:prefix_cache_hits"] > 0, m
    assert triton_backend["attention"] > 0
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_padded_decode_steps_over_fixed_tile_buffers_equal_hf(llama_path, hf_oracle,
                                                              async_scheduling,
                                                              triton_backend, monkeypatch):
    """The CUDA-graph path short of the capture: decode steps padded to their bucket, the
    kernel's tile metadata in the fixed buffers a graph replays over."""
    from raylm.runner.attention.triton_paged import TileBuffers

    monkeypatch.setenv("RAYLM_PAD_DECODE_STEPS", "1")
    fills = []
    real_fill = TileBuffers.fill

    def counted_fill(self, *args):
        fills.append(args[0].size - 1)
        return real_fill(self, *args)

    monkeypatch.setattr(TileBuffers, "fill", counted_fill)
    llm = LLM(llama_path, async_scheduling=async_scheduling, block_size=16, max_num_seqs=6)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = _prompts(vocab, [3, 17, 5, 1, 9], seed=4)
    _check_against_hf(llm, hf_oracle(llama_path), prompts, [14, 9, 20, 6, 17])
    assert 6 in fills and 4 in fills, fills  # 5 and 3 rows ran padded to their buckets
    _assert_no_leak(llm)
    llm.shutdown()
