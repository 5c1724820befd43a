"""Pipeline-parallel transport over torch.distributed (the runner's ``PPTransport``).

Hidden states and residuals go stage to stage on ``ctx.pp_group`` (no shape message: every
rank holds the same SchedulerOutput); the last stage's sampled ids go on a broadcast group
of their own, so they never queue behind hidden states (docs/architecture.md §4). Sends are
non-blocking and keep their buffers until done; a peer is at most
``max_concurrent_batches`` steps behind, so the backlog is bounded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from raylm.parallel.context import ParallelContext
from raylm.parallel.distributed import new_pp_broadcast_group
from raylm.scheduler.config.validation import check_at_least
from raylm.scheduler.core_outputs import SchedulerOutput

# (hidden_states, residual, aux) -> the runner's IntermediateTensors. Injected, because
# parallel sits below runner in the import order (docs/architecture.md §1).
MakeIntermediate = Callable[[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], Any]


class PendingBroadcast:
    """A posted receive of one step's sampled ids (``PendingSampledTokenIds``)."""

    def __init__(self, work, buffer: torch.Tensor) -> None:
        self._work = work
        self._buffer = buffer

    def wait(self) -> torch.Tensor:
        # NCCL: makes the current stream wait for the broadcast (the CPU does not block).
        # gloo: blocks until the ids are here.
        self._work.wait()
        return self._buffer


class _InFlight:
    """Non-blocking sends whose buffers must outlive them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: deque[tuple[list, tuple[torch.Tensor, ...]]] = deque()

    def add(self, works: list, tensors: tuple[torch.Tensor, ...]) -> None:
        self._items.append((works, tensors))
        while self._items and all(w.is_completed() for w in self._items[0][0]):
            self._items.popleft()
        while len(self._items) > self.limit:
            for w in self._items.popleft()[0]:
                w.wait()

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()


class PPCommunicator:
    def __init__(self, ctx: ParallelContext, hidden_size: int, dtype: torch.dtype,
                 broadcast_group, make_intermediate: MakeIntermediate,
                 max_in_flight: int = 8, num_aux_received: int = 0) -> None:
        if ctx.pp_size < 2 or ctx.pp_group is None:
            raise ValueError(f"PPCommunicator needs pp_size >= 2 and a pp_group, got "
                             f"pp_size={ctx.pp_size}, pp_group={ctx.pp_group}.")
        if broadcast_group is None:
            raise ValueError("PPCommunicator needs a broadcast_group (new_pp_broadcast_group).")
        check_at_least("hidden_size", hidden_size)
        self.ctx = ctx
        self.make_intermediate = make_intermediate
        # An EAGLE-3 head's feature-layer inputs from earlier stages: hidden-sized tensors
        # that travel after the residual (IntermediateTensors.aux).
        self.num_aux_received = num_aux_received
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = ctx.device
        self.pp_group = ctx.pp_group
        self.broadcast_group = broadcast_group
        tp = ctx.tp_size
        # Global ranks (torch.distributed's p2p and broadcast name peers by global rank).
        self.prev_rank = ctx.rank - tp if not ctx.is_first_pp_rank else None
        self.next_rank = ctx.rank + tp if not ctx.is_last_pp_rank else None
        self.last_rank = (ctx.pp_size - 1) * tp + ctx.tp_rank
        self._sends = _InFlight(max_in_flight)
        self._broadcasts = _InFlight(max_in_flight)

    # ---- hidden states, stage to stage -------------------------------------------------
    def recv_intermediate(self, scheduler_output: SchedulerOutput) -> Any:
        if self.prev_rank is None:
            raise RuntimeError("the first pipeline stage receives no hidden states.")
        shape = (scheduler_output.total_num_scheduled_tokens, self.hidden_size)
        hidden, residual, *aux = (torch.empty(shape, dtype=self.dtype, device=self.device)
                                  for _ in range(2 + self.num_aux_received))
        works = [dist.irecv(t, src=self.prev_rank, group=self.pp_group)
                 for t in (hidden, residual, *aux)]
        for w in works:
            assert w is not None  # None only for a rank outside pp_group
            w.wait()
        return self.make_intermediate(hidden, residual, tuple(aux))

    def send_intermediate(self, tensors: Any) -> None:
        """``tensors``: the runner's IntermediateTensors (hidden_states, residual, aux)."""
        if self.next_rank is None:
            raise RuntimeError("the last pipeline stage sends no hidden states.")
        hidden = tensors.hidden_states.contiguous()
        residual = tensors.residual
        assert residual is not None, "a stage with layers always has a residual"
        residual = residual.contiguous()
        assert hidden.shape == residual.shape and hidden.shape[-1] == self.hidden_size, (
            f"hidden {tuple(hidden.shape)} / residual {tuple(residual.shape)} vs hidden_size "
            f"{self.hidden_size}")
        aux = tuple(t.contiguous() for t in tensors.aux)
        works = [dist.isend(t, dst=self.next_rank, group=self.pp_group)
                 for t in (hidden, residual, *aux)]
        self._sends.add(works, (hidden, residual, *aux))

    # ---- sampled ids, last stage to the others ---------------------------------------
    def broadcast_sampled_token_ids(self, sampled_token_ids: torch.Tensor) -> None:
        if self.next_rank is not None:
            raise RuntimeError("only the last pipeline stage broadcasts sampled ids.")
        ids = sampled_token_ids.to(torch.int64).contiguous()
        work = dist.broadcast(ids, src=self.last_rank, group=self.broadcast_group,
                              async_op=True)
        self._broadcasts.add([work], (ids,))

    def recv_sampled_token_ids(self, num_rows: int, width: int = 1) -> PendingBroadcast:
        if self.next_rank is None:
            raise RuntimeError("the last pipeline stage samples; it receives no ids.")
        buffer = torch.empty((num_rows, width), dtype=torch.int64, device=self.device)
        work = dist.broadcast(buffer, src=self.last_rank, group=self.broadcast_group,
                              async_op=True)
        return PendingBroadcast(work, buffer)

    def close(self) -> None:
        # Peers may be gone at shutdown: drop the handles instead of waiting on them.
        self._sends.clear()
        self._broadcasts.clear()


def build_pp_transport(ctx: ParallelContext, hidden_size: int, dtype: torch.dtype,
                       make_intermediate: MakeIntermediate,
                       timeout_s: float, num_aux_received: int = 0) -> PPCommunicator | None:
    """The transport of this rank, or None when pp_size is 1. Collective (it creates the
    broadcast group): every rank of the world calls it once, after
    ``init_distributed_environment``."""
    if ctx.pp_size == 1:
        return None
    group = new_pp_broadcast_group(ctx, timeout_s)
    return PPCommunicator(ctx, hidden_size, dtype, group, make_intermediate,
                          num_aux_received=num_aux_received)
