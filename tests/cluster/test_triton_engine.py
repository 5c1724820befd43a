"""The whole engine on the Triton attention kernel (the CUDA path), run on CPU by Triton's
interpreter: greedy tokens equal transformers through chunked prefill, a prefix-cache hit
and preemption, sync and async; a Gemma 2 with sliding-window and global layers (their own
KV cache groups) and capped scores; DeepSeek-V3's latent attention; and the draft model's
forwards take the same kernel."""

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


def test_sliding_windows_and_capped_scores_equal_hf(tmp_path_factory, hf_oracle,
                                                    triton_backend):
    """Gemma 2: layers 0 and 2 see their last 20 keys (blocks before a tile's window are
    skipped, the window masks the rest), layer 1 all of them, every score capped; the
    sliding layers' blocks freed behind their window. Async, a 16-token budget, a shared
    start and a pool too small for every request at once."""
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    path = write_random_checkpoint(
        str(tmp_path_factory.mktemp("gemma2_triton") / "m"),
        CheckpointSpec(architecture="Gemma2ForCausalLM", num_hidden_layers=3,
                       sliding_window=20, head_dim=16, final_logit_softcapping=30.0,
                       attn_logit_softcapping=0.5, seed=38))
    llm = LLM(path, async_scheduling=True, block_size=16, num_kv_blocks=20,
              max_num_batched_tokens=16, max_num_seqs=4)
    vocab = llm.llm_engine.model_config.vocab_size
    shared = _prompts(vocab, [32], seed=9)[0]
    prompts = [shared + p for p in _prompts(vocab, [5, 13], seed=3)]
    prompts += _prompts(vocab, [40, 2], seed=5)
    _check_against_hf(llm, hf_oracle(path), prompts, [30, 24, 28, 20])
    m = llm.get_metrics()
    kv = llm.llm_engine.core.engine_core.scheduler.kv_cache_manager
    assert kv.num_groups == 3 and kv.num_window_freed_blocks > 0
    assert m["raylm:num_preemptions"] > 0 and m["raylm:prefix_cache_hits"] > 0, m
    assert triton_backend["attention"] > 0
    _assert_no_leak(llm)
    llm.shutdown()


def test_latent_attention_equals_hf(tmp_path_factory, hf_oracle, triton_backend):
    """DeepSeek-V3's absorbed latent attention on the kernel: one KV head of 48 channels
    (padded in the kernel), the value read from the key cache; chunked, async."""
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    path = write_random_checkpoint(
        str(tmp_path_factory.mktemp("mla_triton") / "m"),
        CheckpointSpec(architecture="DeepseekV3ForCausalLM", num_hidden_layers=2, seed=45))
    llm = LLM(path, async_scheduling=True, block_size=16, max_num_batched_tokens=16)
    vocab = llm.llm_engine.model_config.vocab_size
    _check_against_hf(llm, hf_oracle(path), _prompts(vocab, [40, 3, 21], seed=4), [12, 16, 9])
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
