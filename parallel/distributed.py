"""Join a torch.distributed world from a rendezvous and build the TP and PP groups.

Rank layout as vLLM: ``tp_rank = rank % tp``, ``pp_rank = rank // tp``. TP groups are
runs of consecutive ranks (one per PP stage); PP groups are strided by ``tp`` (one per TP
index). Backend: nccl when CUDA is present, gloo otherwise. Every wait is bounded by
``timeout_s``: a peer that never joins surfaces as a ``TimeoutError`` naming the rank, the
world and the rendezvous address, never as a hang.
"""

from __future__ import annotations

import datetime
import logging
import os
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from raylm.parallel.context import ParallelContext
from raylm.parallel.rendezvous import StoreRendezvous
from raylm.scheduler.config import envs
from raylm.scheduler.config.validation import check_at_least, check_rank

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0


def tp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    """One TP group per PP stage: consecutive ranks."""
    return [list(range(p * tp_size, (p + 1) * tp_size)) for p in range(pp_size)]


def pp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    """One PP group per TP index: ranks strided by tp_size, first stage first."""
    return [list(range(t, tp_size * pp_size, tp_size)) for t in range(tp_size)]


def _validate(world_size: int, rank: int, tp: int, pp: int, init_method: str | None,
              timeout_s: float) -> None:
    check_at_least("tensor_parallel_size", tp)
    check_at_least("pipeline_parallel_size", pp)
    if world_size != tp * pp:
        raise ValueError(f"world_size must equal tensor_parallel_size * pipeline_parallel_size "
                         f"= {tp} * {pp}, got {world_size}.")
    check_rank("rank", rank, world_size)
    if not init_method or "://" not in init_method:
        raise ValueError(f"distributed_init_method must be a URL such as tcp://host:port, "
                         f"got {init_method!r}.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}.")


def cuda_missing_reason() -> str:
    """Why this process's torch cannot use a GPU it was given."""
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a build without CUDA; install a CUDA build of "
                "torch on the GPU nodes (or run the image the Helm chart names)")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); check the "
            "driver and the device plugin")


def pick_device(local_rank: int, expect_cuda: bool = False) -> tuple[torch.device, str]:
    """(device, backend) of this rank: CUDA and nccl when present, else CPU and gloo.

    ``expect_cuda``: the process was given a GPU (by Ray); then running on CPU would leave
    the GPU idle and the model far slower, so a missing CUDA is an error, not a fallback.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, "nccl"
    if expect_cuda:
        raise RuntimeError(f"this rank was given a GPU but cannot use it: {cuda_missing_reason()}.")
    return torch.device("cpu"), "gloo"


def process_group_kwargs(backend: str, device: torch.device) -> dict:
    """Extra ``init_process_group`` arguments: NCCL binds the default group to the rank's
    device so its communicator (and those split from it for the subgroups) is created now,
    while every rank is in the rendezvous, not lazily at the first collective of a step."""
    return {"device_id": device} if backend == "nccl" else {}


def warm_up_groups(ctx: ParallelContext, rank: int) -> None:
    """One collective on every group this rank belongs to, and one hidden-state-sized p2p
    hop along its PP group, in the same order on every rank: TP, then PP, then the PP
    chain. NCCL creates communicators (p2p pairs included) at their first use and blocks
    until every member joins; a step that posts the sampled-id broadcast before the hidden
    states would otherwise wait on a communicator its peer only creates later."""
    one = torch.ones(1, device=ctx.device)
    for group in (ctx.tp_group, ctx.pp_group):
        if group is not None:
            dist.all_reduce(one, group=group)
    if ctx.pp_group is None:
        return
    tp = ctx.tp_size
    buf = torch.zeros(1, device=ctx.device)
    if not ctx.is_first_pp_rank:
        dist.recv(buf, src=rank - tp, group=ctx.pp_group)
    if not ctx.is_last_pp_rank:
        dist.send(buf, dst=rank + tp, group=ctx.pp_group)


def _set_gloo_ifname(init_method: str) -> None:
    """Gloo binds to the interface its hostname resolves to; pin it when told, or to the
    loopback for a single-node rendezvous on 127.0.0.1 (hostnames often resolve badly in
    containers)."""
    ifname = envs.gloo_socket_ifname()
    if ifname is None and urlparse(init_method).hostname in ("127.0.0.1", "localhost"):
        ifname = "lo"
    if ifname is not None:
        # Gloo reads this itself when it creates its device; setting it is the only hook.
        os.environ["GLOO_SOCKET_IFNAME"] = ifname


def init_distributed_environment(
    *,
    world_size: int,
    rank: int,
    distributed_init_method: str | None,  # None is refused, as any other non-URL
    tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
    local_rank: int = 0,
    dp_rank: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    expect_cuda: bool = False,
    rendezvous: StoreRendezvous | None = None,
) -> ParallelContext:
    """Join the world at ``distributed_init_method`` and return this rank's context.

    Every rank of the world must call this with the same sizes, concurrently: the group
    constructors are collective. ``timeout_s`` bounds the rendezvous and every later
    collective on these groups. ``expect_cuda``: the rank holds a GPU (see ``pick_device``).
    ``rendezvous``: rank 0's store server, already bound (``StoreRendezvous.publish``);
    without it rank 0 starts the server on the URL's port.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    _validate(world_size, rank, tp, pp, distributed_init_method, timeout_s)
    assert distributed_init_method is not None  # _validate refused None
    if dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialized in this process "
            f"(rank {dist.get_rank()} of {dist.get_world_size()}); one rank per process.")
    device, backend = pick_device(local_rank, expect_cuda)
    if backend == "gloo":
        _set_gloo_ifname(distributed_init_method)
    timeout = datetime.timedelta(seconds=timeout_s)
    where = (f"rank {rank} of world_size {world_size} (tp={tp}, pp={pp}) at "
             f"{distributed_init_method} with backend {backend}")
    try:
        store = _rendezvous_store(distributed_init_method, rank, world_size, timeout,
                                  rendezvous)
        dist.init_process_group(backend=backend, store=store, world_size=world_size, rank=rank,
                                timeout=timeout, **process_group_kwargs(backend, device))
        tp_group = _new_groups(tp_group_ranks(tp, pp), rank, backend, timeout)
        pp_group = _new_groups(pp_group_ranks(tp, pp), rank, backend, timeout)
        ctx = ParallelContext(
            tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp, dp_rank=dp_rank,
            device=device,
            # Size-1 dimensions have no group (ParallelContext's convention).
            tp_group=tp_group if tp > 1 else None,
            pp_group=pp_group if pp > 1 else None,
        )
        warm_up_groups(ctx, rank)
    except (dist.DistError, RuntimeError) as e:
        if dist.is_initialized():
            dist.destroy_process_group()
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise TimeoutError(
                f"torch.distributed rendezvous timed out after {timeout_s:g}s on {where}: "
                f"not every peer joined. Cause: {e}") from e
        raise RuntimeError(f"torch.distributed init failed on {where}: {e}") from e
    logger.info("Joined %s.", where)
    return ctx


def _rendezvous_store(init_method: str, rank: int, world_size: int,
                      timeout: datetime.timedelta, rendezvous: StoreRendezvous | None
                      ) -> dist.Store:
    """The default group's store: rank 0's held server, else the URL's (rank 0 serves it,
    the others connect). Prefixed as torch prefixes a store it builds from a URL."""
    if rendezvous is not None:
        if rank != 0:
            raise ValueError(f"only rank 0 holds the rendezvous store, not rank {rank}.")
        store: dist.Store = rendezvous.store
    else:
        url = urlparse(init_method)
        if url.scheme != "tcp" or url.hostname is None or not url.port:
            raise ValueError(f"distributed_init_method must be tcp://host:port, got "
                             f"{init_method!r}.")
        store = dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0,
                              timeout=timeout)
    return dist.PrefixStore("raylm-world", store)


def _new_groups(all_ranks: list[list[int]], rank: int, backend: str,
                timeout: datetime.timedelta):
    """Create every group (a collective call on all ranks); return the one holding ``rank``."""
    mine = None
    for ranks in all_ranks:
        if len(ranks) == 1:
            continue  # nothing to communicate; ParallelContext holds None for it
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            mine = group
    return mine


def new_pp_broadcast_group(ctx: ParallelContext, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A second PP group with the same ranks as ``ctx.pp_group``, for the last stage's
    sampled-token broadcast: on its own group (its own gloo pairs / NCCL communicator and
    stream) it never queues behind, or interleaves with, the stage-to-stage hidden states.

    Collective over the whole world: every rank calls it once, in the same order relative
    to other group creations. Returns None when pp_size is 1."""
    if not dist.is_initialized():
        raise RuntimeError("new_pp_broadcast_group needs torch.distributed initialized "
                           "(init_distributed_environment).")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
    if ctx.pp_size == 1:
        return None
    group = _new_groups(pp_group_ranks(ctx.tp_size, ctx.pp_size), dist.get_rank(),
                        dist.get_backend(), datetime.timedelta(seconds=timeout_s))
    # Created now (see warm_up_groups), not by the first step's broadcast.
    dist.all_reduce(torch.ones(1, device=ctx.device), group=group)
    return group


def destroy_distributed_environment() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
