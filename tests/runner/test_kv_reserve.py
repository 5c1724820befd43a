"""KV-cache sizing on a GPU: the step reserve follows what a step can touch (token budget,
rows, the ragged kernel's workspace cap), so a long-context model starts; a pool that cannot
hold one request of max_model_len is refused naming the longest that fits. Checked on the
arithmetic (no GPU) and through a CPU engine with a byte budget."""

from __future__ import annotations

import pytest
import torch

from raylm.parallel.context import ParallelContext
from raylm.runner.attention.paged_attention import RAGGED_WORKSPACE_BYTES
from raylm.runner.memory_budget import (
    GIB,
    NCCL_COMMUNICATOR_RESERVE_BYTES,
    RankAttentionShape,
    kv_cache_budget_bytes,
    num_kv_blocks_for,
    step_reserve_bytes,
)
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 131072}
BF16 = 2
KV_BYTES_PER_TOKEN_8B = 32 * 2 * 8 * 128 * BF16  # layers x (K, V) x KV heads x head_dim


def _config(max_num_seqs: int = 128, max_model_len: int = 131072) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model="llama31-8b", max_model_len=max_model_len, hf_config=LLAMA31_8B),
        CacheConfig(), SchedulerConfig(max_num_seqs=max_num_seqs), ParallelConfig())


def test_a_131072_context_8b_model_keeps_most_of_an_80gb_gpu_for_kv():
    """Llama-3.1-8B at TP=1 on an 80 GiB GPU with its 16 GiB of weights loaded: the old
    reserve (max_num_seqs x max_model_len decode gathers) was ~66 GiB and left the KV
    budget negative; now the reserve is a few GiB and the pool holds several full-length
    requests."""
    reserve = step_reserve_bytes(_config(), ParallelContext.single("cpu"), BF16)
    assert reserve < 6 * GIB, reserve / GIB
    total, weights = 80 * GIB, 16 * GIB
    budget = kv_cache_budget_bytes(total - weights, total, 0.9, reserve)
    per_block = 16 * KV_BYTES_PER_TOKEN_8B
    blocks = num_kv_blocks_for(budget, per_block, 16, 131072, "test")
    assert blocks * 16 >= 3 * 131072, blocks
    # What the old formula reserved for the decode gathers alone, for the record.
    old_decode = 128 * 131072 * (2 * 8 * 128 * BF16 + 32 * 4)
    assert total - weights - total * 0.1 - old_decode < 0


def test_reserve_grows_with_the_token_budget_not_with_max_model_len_times_rows():
    ctx = ParallelContext.single("cpu")
    short = step_reserve_bytes(_config(max_model_len=8192), ctx, BF16)
    long = step_reserve_bytes(_config(max_model_len=131072), ctx, BF16)
    # Only the prefill chunk's context (and the ragged kernel up to its cap) grow.
    assert long - short < 2 * GIB, (long - short) / GIB
    shape = RankAttentionShape.of(DecoderConfig.from_hf(LLAMA31_8B), 1)
    assert shape.max_ragged_pairs(16, BF16) * 16 * 2 * 8 * 128 * BF16 <= RAGGED_WORKSPACE_BYTES


def test_reserve_counts_each_communicator():
    group = object()
    tp2 = ParallelContext(tp_rank=0, tp_size=2, pp_rank=0, pp_size=2, dp_rank=0,
                          device=torch.device("cpu"), tp_group=group, pp_group=group)
    config = _config(max_num_seqs=1, max_model_len=16)
    single = step_reserve_bytes(config, ParallelContext.single("cpu"), BF16)
    sharded = step_reserve_bytes(config, tp2, BF16)
    # TP, PP, the sampled-id broadcast and the p2p pair: four communicators (the sharded
    # rank's smaller attention heads only lower its other terms).
    assert sharded - single >= 4 * NCCL_COMMUNICATOR_RESERVE_BYTES - (64 << 20), (sharded, single)


def test_a_pool_short_of_one_full_request_names_the_longest_that_fits():
    per_block = 16 * KV_BYTES_PER_TOKEN_8B
    with pytest.raises(ValueError, match=r"max_model_len=131072 .* the longest max_model_len "
                                         r"this memory holds is 65536"):
        num_kv_blocks_for(4096 * per_block + 5, per_block, 16, 131072, "test")
    with pytest.raises(ValueError, match="longest max_model_len this memory holds is 0"):
        num_kv_blocks_for(-GIB, per_block, 16, 131072, "test")
    assert num_kv_blocks_for(8192 * per_block, per_block, 16, 131072, "test") == 8192
    # A sliding window on every layer: a request holds only its window's blocks at once.
    assert num_kv_blocks_for(300 * per_block, per_block, 16, 131072, "test",
                             blocks_per_request=300) == 300
    with pytest.raises(ValueError, match="a request holds up to 300 blocks at once"):
        num_kv_blocks_for(299 * per_block, per_block, 16, 131072, "test",
                          blocks_per_request=300)


def test_a_131072_context_checkpoint_starts_on_cpu(tmp_path):
    """A tiny checkpoint that declares 131072 positions runs at that max_model_len with a
    byte budget for its KV cache; with too small a budget the engine refuses to start and
    names the longest max_model_len that fits."""
    from raylm import LLM, SamplingParams
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    path = write_random_checkpoint(str(tmp_path / "long"),
                                   CheckpointSpec(max_position_embeddings=131072))
    per_token = 2 * 2 * 2 * 16 * 4  # tiny llama: layers x (K, V) x KV heads x head_dim x fp32
    with LLM(path, kv_cache_memory_bytes=2 * 131072 * per_token, max_num_seqs=4,
             dtype="float32") as llm:
        assert llm.llm_engine.model_config.max_model_len == 131072
        assert llm.llm_engine.core.engine_core.num_kv_blocks * 16 >= 131072
        out = llm.generate([[5, 9, 33]], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="longest max_model_len this memory holds is 65536"):
        LLM(path, kv_cache_memory_bytes=65536 * per_token + 1, max_num_seqs=4,
            dtype="float32")


def test_the_triton_kernel_needs_no_attention_workspace_and_graphs_their_pool():
    ctx = ParallelContext.single("cpu")
    native = step_reserve_bytes(_config(), ctx, BF16)
    triton = step_reserve_bytes(_config(), ctx, BF16, "triton")
    graphs = step_reserve_bytes(_config(), ctx, BF16, "triton", cuda_graphs=True)
    assert native - triton > GIB  # the ragged kernel's chunk and a prefill's gather
    width = 4096 * 4 + 3 * 14336
    assert graphs - triton == 2 * 128 * width * BF16
