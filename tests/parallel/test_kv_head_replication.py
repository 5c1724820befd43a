"""TP larger than the KV-head count: each KV head is replicated over tp/num_kv_heads ranks,
and each rank holds the head its query heads use; greedy output equals transformers."""

from __future__ import annotations

import pytest
import torch
from tp_rank_main import tp_ranks

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import QKVParallelLinear
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

F32 = torch.float32
PROMPT = [5, 9, 33, 70, 2, 41]


def _ctx(rank: int, size: int) -> ParallelContext:
    return ParallelContext(tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, dp_rank=0,
                           device=torch.device("cpu"), tp_group=object() if size > 1 else None)


@pytest.mark.parametrize("tp,kv_heads", [(4, 2), (4, 1), (2, 1)])
def test_each_rank_loads_the_kv_head_of_its_query_heads(tp, kv_heads):
    heads, head_dim = 8, 2
    group = heads // kv_heads  # query heads per KV head
    q = torch.arange(heads * head_dim, dtype=F32)[:, None].expand(-1, 3)
    k = 100 + torch.arange(kv_heads * head_dim, dtype=F32)[:, None].expand(-1, 3)
    v = 200 + torch.arange(kv_heads * head_dim, dtype=F32)[:, None].expand(-1, 3)
    for rank in range(tp):
        qkv = QKVParallelLinear(3, head_dim, heads, kv_heads, False, ctx=_ctx(rank, tp),
                                params_dtype=F32)
        assert (qkv.num_heads, qkv.num_kv_heads) == (heads // tp, 1)
        for shard_id, t in (("q", q), ("k", k), ("v", v)):
            qkv.weight.weight_loader(qkv.weight, t, shard_id)
        q_heads = range(rank * heads // tp, (rank + 1) * heads // tp)
        kv_head = q_heads[0] // group
        assert {h // group for h in q_heads} == {kv_head}, "a rank's query heads share one KV head"
        expect = [float(h * head_dim + d) for h in q_heads for d in range(head_dim)]
        expect += [100.0 + kv_head * head_dim + d for d in range(head_dim)]
        expect += [200.0 + kv_head * head_dim + d for d in range(head_dim)]
        assert qkv.weight[:, 0].tolist() == expect, (rank, qkv.weight[:, 0].tolist())


def test_tp_not_a_multiple_of_kv_heads_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must be a multiple of "
                                         "num_key_value_heads=2"):
        QKVParallelLinear(3, 2, 6, 2, False, ctx=_ctx(0, 3), params_dtype=F32)


def test_tp2_with_one_kv_head_is_greedy_equal_to_transformers(tmp_path, hf_oracle):
    path = write_random_checkpoint(str(tmp_path / "mqa"), CheckpointSpec(
        num_attention_heads=4, num_key_value_heads=1, seed=7))
    with tp_ranks([path]) as collect:
        expected = hf_oracle(path).greedy(PROMPT, 5)
        outs = collect()
    for rank in (0, 1):
        assert outs[rank]["tokens"][path] == expected, (rank, outs[rank]["tokens"][path], expected)
