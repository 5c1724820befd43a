"""KV-cache sizing on GPU leaves room for the decode attention workspace and the
communicators' buffers, not only a fixed reserve (checked on the arithmetic; no GPU)."""

from __future__ import annotations

import types

import torch

from raylm.parallel.context import ParallelContext
from raylm.runner.worker import NCCL_COMMUNICATOR_RESERVE_BYTES, Worker
from raylm.scheduler.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 8192}


def _reserve(ctx: ParallelContext, max_num_seqs: int = 128, max_model_len: int = 8192) -> int:
    config = EngineConfig(
        ModelConfig(model="llama3-8b", max_model_len=max_model_len, hf_config=LLAMA3_8B),
        CacheConfig(), SchedulerConfig(max_num_seqs=max_num_seqs), ParallelConfig())
    worker = Worker(config)
    worker.ctx = ctx
    worker.model_runner = types.SimpleNamespace(dtype=torch.bfloat16)
    return worker._activation_reserve_bytes()


def test_reserve_covers_the_decode_workspace_of_an_8b_model():
    # K and V of 128 requests x 8k tokens x 8 KV heads x 128 dims in bf16: 4 GiB.
    workspace = 2 * 128 * 8192 * 8 * 128 * 2
    single = _reserve(ParallelContext.single("cpu"))
    assert single >= workspace, (single, workspace)
    assert _reserve(ParallelContext.single("cpu"), max_num_seqs=8) < single / 2


def test_reserve_counts_each_communicator():
    group = object()
    tp2 = ParallelContext(tp_rank=0, tp_size=2, pp_rank=0, pp_size=2, dp_rank=0,
                          device=torch.device("cpu"), tp_group=group, pp_group=group)
    single = _reserve(ParallelContext.single("cpu"), max_num_seqs=1, max_model_len=16)
    sharded = _reserve(tp2, max_num_seqs=1, max_model_len=16)
    # TP, PP, the sampled-id broadcast and the p2p pair: four communicators.
    assert sharded - single >= 4 * NCCL_COMMUNICATOR_RESERVE_BYTES - (1 << 20), (sharded, single)
