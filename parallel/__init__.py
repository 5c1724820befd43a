"""Parallel context, TP collectives and tensor-parallel layers (torch.distributed)."""

from raylm.parallel.communication import tp_all_gather, tp_all_reduce
from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_pp_layer_range,
)

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelContext",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "get_pp_layer_range",
    "tp_all_gather",
    "tp_all_reduce",
]
