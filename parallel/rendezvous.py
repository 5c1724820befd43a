"""A TCPStore rendezvous whose server holds its port from the start.

The server binds an OS-picked port and keeps it (``StoreRendezvous.publish``); the host
then hands (host, port) to its peers. Picking a free port by binding and closing a socket
and starting the store on it later races with any other process that binds meanwhile.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist

from raylm.scheduler.config.validation import check_at_least


def store_timeout(timeout_s: float) -> datetime.timedelta:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
    return datetime.timedelta(seconds=timeout_s)


@dataclass
class StoreRendezvous:
    """The TCPStore server, held by the hosting rank for the life of its group."""

    host: str
    port: int
    store: dist.TCPStore = field(repr=False)

    @classmethod
    def publish(cls, host: str, world_size: int, timeout_s: float) -> StoreRendezvous:
        """Start the store on an OS-picked port; peers reach it at (``host``, port)."""
        check_at_least("world_size", world_size)
        store = dist.TCPStore(host, 0, world_size, is_master=True,
                              timeout=store_timeout(timeout_s), wait_for_workers=False)
        return cls(host=host, port=store.port, store=store)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"
