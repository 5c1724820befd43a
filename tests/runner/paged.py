"""Test helper: run a model over hand-built paged steps (teacher-forced token ids)."""

from __future__ import annotations

import random

import numpy as np
import torch

from raylm.runner.attention.paged_attention import allocate_kv_cache, build_attention_metadata


class PagedSequences:
    """Block tables (shuffled block ids) and KV caches for a set of test sequences."""

    def __init__(self, models, lengths: dict[str, int], block_size: int = 4,
                 num_blocks: int = 64, seed: int = 0) -> None:
        self.block_size = block_size
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        self.block_tables = {}
        for name, length in lengths.items():
            n = -(-length // block_size)
            self.block_tables[name], ids = ids[:n], ids[n:]
        self.max_blocks = max(len(t) for t in self.block_tables.values())
        for model in models:
            for attn in model.attention_layers:
                attn.kv_cache = allocate_kv_cache(num_blocks, block_size, attn.num_kv_heads,
                                                  attn.head_dim, torch.float32, "cpu")

    def step(self, tokens: dict[str, torch.Tensor], chunks: list[tuple[str, int, int]]):
        """Inputs for one step computing positions [start, end) of each named sequence."""
        bs = self.block_size
        ids, pos, slots, table, qsl, seq_lens = [], [], [], [], [0], []
        for name, start, end in chunks:
            bt = self.block_tables[name]
            p = torch.arange(start, end)
            ids.append(tokens[name][start:end])
            pos.append(p)
            slots.append(torch.tensor(bt)[p // bs] * bs + p % bs)
            table.append(bt + [0] * (self.max_blocks - len(bt)))
            qsl.append(qsl[-1] + end - start)
            seq_lens.append(end)
        meta = build_attention_metadata(np.array(qsl), np.array(seq_lens), torch.cat(slots),
                                        torch.tensor(table, dtype=torch.int64), bs)
        return torch.cat(ids), torch.cat(pos), meta
