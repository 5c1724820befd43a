"""Sharded layers: weight loaders, PP layer ranges, and a real 2-process TP run whose
logits equal the single-process model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tp_rank_main import greedy_tokens, run_steps, tp_ranks

from raylm.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelContext,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_pp_layer_range,
    tp_all_gather,
    tp_all_reduce,
)

F32 = torch.float32


def _ctx(rank: int, size: int) -> ParallelContext:
    # Loader-only tests: a stand-in group object (no collective is called).
    return ParallelContext(tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, dp_rank=0,
                           device=torch.device("cpu"), tp_group=object() if size > 1 else None)


def test_context_validation():
    ctx = ParallelContext.single("cpu")
    assert ctx.is_first_pp_rank and ctx.is_last_pp_rank and ctx.is_driver and ctx.rank == 0
    with pytest.raises(ValueError, match="tp_rank"):
        ParallelContext(tp_rank=2, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0,
                        device=torch.device("cpu"), tp_group=object())
    with pytest.raises(ValueError, match="tp_group"):
        ParallelContext(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0,
                        device=torch.device("cpu"))
    stage = ParallelContext(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, dp_rank=0,
                            device=torch.device("cpu"), tp_group=object())
    assert stage.rank == 3 and not stage.is_first_pp_rank and not stage.is_driver


def test_pp_layer_ranges():
    assert [get_pp_layer_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert get_pp_layer_range(2, 1, 2) == (1, 2)
    with pytest.raises(ValueError, match="smaller than pipeline_parallel_size"):
        get_pp_layer_range(2, 0, 3)
    with pytest.raises(ValueError, match="pp_rank"):
        get_pp_layer_range(4, 2, 2)


def test_column_and_row_loaders_keep_this_ranks_shard():
    w = torch.arange(8 * 6, dtype=F32).reshape(8, 6)
    col = ColumnParallelLinear(6, 8, True, ctx=_ctx(1, 2), params_dtype=F32)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, torch.arange(8, dtype=F32))
    assert torch.equal(col.weight, w[4:]) and col.bias.tolist() == [4, 5, 6, 7]
    row = RowParallelLinear(6, 8, True, ctx=_ctx(1, 2), params_dtype=F32)
    row.weight.weight_loader(row.weight, w)
    row.bias.weight_loader(row.bias, torch.arange(8, dtype=F32))
    assert torch.equal(row.weight, w[:, 3:]) and row.bias.tolist() == list(range(8))
    with pytest.raises(ValueError, match="shape"):
        col.weight.weight_loader(col.weight, torch.zeros(8, 5))


def test_merged_and_qkv_loaders_place_each_shard():
    merged = MergedColumnParallelLinear(3, [4, 4], False, ctx=_ctx(1, 2), params_dtype=F32)
    gate, up = torch.full((4, 3), 1.0), torch.full((4, 3), 2.0)
    gate[2:] = 10.0
    up[2:] = 20.0
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    assert merged.weight[:, 0].tolist() == [10.0, 10.0, 20.0, 20.0]
    # 4 query heads, 2 KV heads, head_dim 2, tp=2 -> per rank 2 q heads, 1 KV head.
    qkv = QKVParallelLinear(3, 2, 4, 2, False, ctx=_ctx(1, 2), params_dtype=F32)
    q = torch.arange(8, dtype=F32)[:, None].expand(8, 3)
    k = 100 + torch.arange(4, dtype=F32)[:, None].expand(4, 3)
    v = 200 + torch.arange(4, dtype=F32)[:, None].expand(4, 3)
    for shard_id, t in (("q", q), ("k", k), ("v", v)):
        qkv.weight.weight_loader(qkv.weight, t, shard_id)
    assert qkv.weight[:, 0].tolist() == [4, 5, 6, 7, 102, 103, 202, 203]
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible"):
        QKVParallelLinear(3, 2, 6, 2, False, ctx=_ctx(0, 4), params_dtype=F32)


def test_vocab_parallel_embedding_pads_the_last_shard():
    emb = VocabParallelEmbedding(5, 2, ctx=_ctx(1, 2), params_dtype=F32)
    full = torch.arange(10, dtype=F32).reshape(5, 2)
    emb.weight.weight_loader(emb.weight, full)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (3, 5)
    assert emb.weight.tolist() == [[6, 7], [8, 9], [0, 0]]
    single = ParallelLMHead(5, 2, ctx=_ctx(0, 1), params_dtype=F32)
    single.weight.weight_loader(single.weight, full)
    hidden = torch.tensor([[1.0, 0.5]])
    torch.testing.assert_close(single.compute_logits(hidden), hidden @ full.T)


def test_collectives_are_noops_without_tp():
    x = torch.randn(3, 4)
    ctx = ParallelContext.single("cpu")
    assert tp_all_reduce(x, ctx) is x and tp_all_gather(x, ctx) is x


def test_tensor_parallel_logits_equal_single_process(llama_path, qwen2_path, llama_mha_tied_path):
    """Two gloo ranks load each model with tp=2: logits equal tp=1 within 1e-5 (GQA with
    one KV head per rank, Qwen2 biases, tied vocab-parallel embedding) and greedy
    decoding through the ModelRunner picks the same tokens on both ranks."""
    from raylm.parallel.context import ParallelContext as Ctx
    from raylm.runner.loading.model_loader import get_model
    from raylm.runner.model_runner import ModelRunner
    from raylm.scheduler.config.engine_config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    paths = [llama_path, qwen2_path, llama_mha_tied_path]
    with tp_ranks(paths) as collect:
        expected = {}
        for path in paths:
            model = get_model(ModelConfig(model=path), Ctx.single("cpu"))
            logits = [t.numpy() for t in run_steps(model)]
            config = EngineConfig(ModelConfig(model=path), CacheConfig(block_size=4),
                                  SchedulerConfig(async_scheduling=False), ParallelConfig())
            runner = ModelRunner(config, Ctx.single("cpu"))
            runner.load_model(model)
            runner.initialize_kv_cache(8)
            expected[path] = (logits, greedy_tokens(runner, [5, 9, 33, 70, 2, 41], 5))
        outs = collect()
    for path in paths:
        logits, tokens = expected[path]
        for rank in (0, 1):
            got = outs[rank]["logits"][path]
            for step, (g, e) in enumerate(zip(got, logits, strict=True)):
                assert np.abs(g - e).max() < 1e-5, (path, rank, step, np.abs(g - e).max())
            assert outs[rank]["tokens"][path] == tokens
