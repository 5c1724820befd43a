"""Expert parallelism across DP ranks: the Gloo group a mixture of experts dispatches its
tokens over when its experts are spread over the DP ranks (docs/architecture.md §19).

Each DP rank serves its own requests, so a sparse layer first gathers every rank's routed
tokens (padded to the largest rank's count: Gloo gathers equal shapes), runs its own
experts on all of them, and sums the partial outputs over the ranks; each rank keeps its
own rows. Every rank must run each sparse layer's collectives in the same order, which the
DP wave loop guarantees by running a dummy pass (no rows) on a rank without a forward of
its own in a wave step (docs/architecture.md §5).

With tensor parallelism inside each DP rank (EP = DP x TP) the group joins the workers of
one (pipeline stage, TP rank) across the DP ranks: a TP rank's peers in other DP ranks hold
other experts, and its TP peers in its own DP rank the rest (``ep_rank``); the TP
all-reduce after the DP sum completes every token's output.

The group is created unjoined, when the model is built (the experts a rank holds follow
from its DP rank), and joined once the DP ranks have met (``attach``).
"""

from __future__ import annotations

from typing import Any

import torch


class DPExpertGroup:
    def __init__(self, dp_rank: int, dp_size: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}.")
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self._pg: Any = None
        self._store: Any = None

    def attach(self, pg: Any, store: Any = None) -> None:
        """The joined Gloo group over the DP ranks (rank order = DP rank); ``store``: its
        store client, kept alive with it."""
        self._pg = pg
        self._store = store

    def ep_rank(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """(rank, size) among every (DP, TP) rank that splits the experts."""
        return self.dp_rank * tp_size + tp_rank, self.dp_size * tp_size

    @property
    def joined(self) -> bool:
        return self._pg is not None

    def _group(self) -> Any:
        if self._pg is None:
            raise RuntimeError(f"DP rank {self.dp_rank}: the expert-parallel group is not "
                               "joined yet (the DP ranks join it after loading).")
        return self._pg

    def gather_rows(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """Every rank's rows of each tensor (same row count within a rank), concatenated in
        rank order; and each rank's row count."""
        pg = self._group()
        count = torch.tensor([tensors[0].shape[0]], dtype=torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.dp_size)]
        pg.allgather([counts], [count]).wait()
        sizes = [int(c) for c in counts]
        rows = max(sizes)
        gathered = []
        for t in tensors:
            padded = t.new_zeros((rows, *t.shape[1:]))
            padded[:t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in range(self.dp_size)]
            pg.allgather([parts], [padded]).wait()
            gathered.append(torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]))
        return gathered, sizes

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        self._group().allreduce([t]).wait()
        return t
