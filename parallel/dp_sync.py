"""The Gloo CPU process group that keeps DP ranks in lockstep waves (docs/architecture.md §5).

It is stateless (a ProcessGroupGloo on its own TCPStore, never the default group) because
a rank's workers may already own torch.distributed's default group. DP rank 0 hosts the
store on an OS-picked port; every wait is bounded by ``timeout_s``, so a lost rank raises
instead of hanging (the DP loop turns that into an EngineDeadError).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from raylm.parallel.rendezvous import StoreRendezvous, store_timeout
from raylm.scheduler.config import envs
from raylm.scheduler.config.validation import check_rank

logger = logging.getLogger(__name__)

DEFAULT_DP_TIMEOUT_S = 120.0
_LOOPBACK = ("127.0.0.1", "localhost")


def gloo_device(rendezvous_host: str, local_host: str | None):
    """The interface Gloo binds: GLOO_SOCKET_IFNAME when set, else this node's address
    (hostnames often resolve badly in containers), the loopback for a local rendezvous."""
    ifname = envs.gloo_socket_ifname()
    if ifname is not None:
        return dist.ProcessGroupGloo.create_device(interface=ifname)
    if rendezvous_host in _LOOPBACK:
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    if local_host:
        return dist.ProcessGroupGloo.create_device(hostname=local_host)
    return dist.ProcessGroupGloo.create_default_device()


def _gloo_group(store: dist.Store, prefix: str, rank: int, size: int, device: object,
                timeout: datetime.timedelta | None) -> dist.ProcessGroupGloo:
    # Private pybind class, absent from torch's stubs (the public Options takes no devices).
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    if timeout is not None:
        opts._timeout = timeout
    opts._devices = [device]
    # A prefix keeps this group's keys apart from anything else on the store.
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)


def join_gloo_group(*, host: str, port: int, prefix: str, rank: int, size: int,
                    timeout_s: float = DEFAULT_DP_TIMEOUT_S, local_host: str | None = None
                    ) -> tuple[dist.ProcessGroupGloo, dist.Store]:
    """Collective over ``size`` processes: a Gloo group on the store at (host, port) that
    another process hosts (DP rank 0's), its keys under ``prefix``. Returns the group and
    the store client, which must live as long as the group."""
    check_rank("rank", rank, size)
    timeout = store_timeout(timeout_s)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    return _gloo_group(store, prefix, rank, size, gloo_device(host, local_host), timeout), store


class DPSyncGroup:
    """One rank's handle on the DP Gloo group: small int all-reduces, bounded in time."""

    def __init__(self, pg: dist.ProcessGroupGloo, dp_rank: int, dp_size: int, where: str,
                 store: dist.Store, device: object = None,
                 timeout: datetime.timedelta | None = None) -> None:
        self._pg = pg
        self._store = store  # keep the client connection alive as long as the group
        self._device = device
        self._timeout = timeout
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.where = where

    def sibling_group(self, prefix: str) -> dist.ProcessGroupGloo:
        """Collective: another Gloo group over the same DP ranks and store, for traffic
        of another thread (a group's collectives must not interleave between threads)."""
        return _gloo_group(self._store, prefix, self.dp_rank, self.dp_size, self._device,
                           self._timeout)

    @classmethod
    def join(cls, *, host: str, port: int, dp_rank: int, dp_size: int,
             timeout_s: float = DEFAULT_DP_TIMEOUT_S, local_host: str | None = None,
             rendezvous: StoreRendezvous | None = None) -> DPSyncGroup:
        """Collective: every DP rank calls this concurrently. Rank 0 passes its
        ``rendezvous`` (it holds the store server)."""
        check_rank("dp_rank", dp_rank, dp_size)
        if not 0 < port < 65536:
            raise ValueError(f"port must be in (0, 65536), got {port}.")
        timeout = store_timeout(timeout_s)
        where = f"DP rank {dp_rank} of {dp_size} at {host}:{port}"
        try:
            store = rendezvous.store if rendezvous is not None else dist.TCPStore(
                host, port, dp_size, is_master=False, timeout=timeout)
            device = gloo_device(host, local_host)
            pg = _gloo_group(store, "raylm-dp", dp_rank, dp_size, device, timeout)
        except (dist.DistError, RuntimeError) as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TimeoutError(f"DP group rendezvous timed out after {timeout_s:g}s on "
                                   f"{where}: not every DP rank joined. Cause: {e}") from e
            raise RuntimeError(f"DP group init failed on {where}: {e}") from e
        logger.info("Joined the DP Gloo group as %s.", where)
        return cls(pg, dp_rank, dp_size, where, store, device, timeout)

    def _all_reduce(self, values: list[int], op: dist.ReduceOp.RedOpType) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        # torch's stubs type ReduceOp.MAX as RedOpType; pybind converts it to a ReduceOp.
        opts.reduceOp = op  # type: ignore[assignment]
        try:
            # The stubs give Backend subclasses no allreduce; ProcessGroupGloo has it.
            self._pg.allreduce([tensor], opts).wait()  # type: ignore[attr-defined]
        except (dist.DistError, RuntimeError) as e:
            raise RuntimeError(f"DP all-reduce failed on {self.where} (a peer is dead, "
                               f"stuck or gone): {e}") from e
        return tensor.tolist()

    def all_reduce_max(self, values: list[int]) -> list[int]:
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def destroy(self) -> None:
        # Drop the references; Gloo closes its sockets when the group is freed.
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]
