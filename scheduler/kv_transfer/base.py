"""The scheduler side of a KV connector (vLLM V1's split): what can come from outside.

A connector moves KV blocks between this engine's device pool and somewhere else (a host
tier, a peer engine). Its scheduler side is pure Python and decides; its worker side
(raylm.runner.kv_transfer) moves the bytes, steered by the metadata each SchedulerOutput
carries. The scheduler asks, for a request it admits, how many tokens past its device
prefix hit can be loaded and whether the load is asynchronous (the request then waits in
WAITING_FOR_REMOTE_KVS, outside the running batch); tells it which blocks were allocated
for them; hands each step's orders to the workers; and, when a request finishes, asks
whether its blocks must outlive it because they are still being sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raylm.scheduler.config.kv_transfer_config import KVTransferConfig
    from raylm.scheduler.core_outputs import KVConnectorOutput, SchedulerOutput
    from raylm.scheduler.request import Request


@dataclass
class KVConnectorMetadata:
    """One step's orders to the workers' side of a connector; subclassed per connector."""

    def load_block_ids(self) -> list[int]:
        """Device blocks this step's orders load into (what a fault injector may spoil)."""
        return []

    def is_empty(self) -> bool:
        return True


@dataclass
class ConnectorStats:
    """Counters the scheduler side keeps (the worker side's come in KVConnectorOutput)."""

    external_queries: int = 0  # tokens asked of the connector (vLLM's external prefix cache)
    external_hits: int = 0  # tokens it had
    extra: dict[str, float] = field(default_factory=dict)


class KVConnectorScheduler:
    """Base: a connector that never has anything; subclasses override what they do."""

    def __init__(self, config: KVTransferConfig, block_size: int,
                 get_block_ids: Callable[[str], list[int]] | None = None) -> None:
        """``get_block_ids``: a request's block table (the KV cache manager's)."""
        self.config = config
        self.block_size = block_size
        self.stats = ConnectorStats()
        self.get_block_ids = get_block_ids or (lambda request_id: [])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (a whole-block device hit) the connector can
        load, in whole blocks except at the end of the prompt, and whether the load is
        asynchronous. Never all of the request's known tokens: the last one is computed."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        """Blocks are allocated: ``block_ids`` is the request's whole block table, the
        external tokens go right after its ``num_local_tokens`` device-hit tokens."""

    def on_block_evicted(self, block_hash: int, block_id: int) -> None:
        """A cached device block is about to be reused (an offload tier saves it first)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: Mapping[str, Request]) -> KVConnectorMetadata | None:
        """This step's orders (None: nothing); resets the step's pending state."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A step's report from the workers (finished transfers, failed blocks)."""

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Whether the finished request's blocks must stay allocated until the workers
        report it in ``finished_sending`` / ``finished_recving`` (or it expires), and the
        ``kv_transfer_params`` its final output carries to a peer."""
        return False, None

    def take_expired(self, now: float) -> list[str]:
        """Finished requests whose blocks were held for a transfer that never came."""
        return []

    def has_pending_work(self) -> bool:
        """Orders for the workers that need a step even when nothing is scheduled."""
        return False

    def release(self, request_ids: list[str]) -> list[str]:
        """A peer has its copy of these finished requests' KV: the ids that were held."""
        return []
