"""Where this rank sits in the TP x PP (x DP) layout, passed explicitly to layers and models.

There are no module-level process groups: whoever builds a model hands it a
``ParallelContext``. Single-process runs use ``ParallelContext.single(device)``; the
distributed bootstrap (a later layer) fills in the ranks and the torch.distributed groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raylm.scheduler.config.validation import check_at_least, check_rank


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    device: torch.device
    # torch.distributed ProcessGroup objects, or None when the dimension has size 1.
    tp_group: Any = None
    pp_group: Any = None
    # Sparse expert layers split their experts over the TP ranks (each rank whole experts)
    # instead of every expert's intermediate dimension (enable_expert_parallel).
    expert_parallel: bool = False
    # With DP > 1 (TP = PP = 1): the experts spread over the DP ranks instead, the tokens
    # dispatched through this parallel/expert_parallel.DPExpertGroup.
    ep_group: Any = None

    def __post_init__(self) -> None:
        for name, rank, size in (("tp_rank", self.tp_rank, self.tp_size),
                                 ("pp_rank", self.pp_rank, self.pp_size)):
            check_at_least(name.replace("rank", "size"), size)
            check_rank(name, rank, size)
        if self.dp_rank < 0:
            raise ValueError(f"dp_rank must be non-negative, got {self.dp_rank}.")
        if self.tp_size > 1 and self.tp_group is None:
            raise ValueError(f"tp_size={self.tp_size} needs a tp_group, got None.")

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        return cls(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0,
                   device=torch.device(device))

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def rank(self) -> int:
        """Rank in the TP x PP world of one DP replica (vLLM layout: tp fastest)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_driver(self) -> bool:
        """The rank whose ModelRunnerOutput goes back to the EngineCore."""
        return self.tp_rank == 0 and self.is_last_pp_rank
