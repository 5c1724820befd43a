"""The model runner's side of a KV connector: a step's orders in, its report out.

Before a step the connector gets the step's metadata and starts its loads; each layer's
attention waits for its own (the connector is bound to the attention modules with the
cache); after the step its report rides on the step's output, or, when the step's
sampling is deferred (structured outputs) and it has no output yet, on the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raylm.parallel.context import ParallelContext
from raylm.runner.async_output import AsyncModelRunnerOutput
from raylm.runner.kv_transfer.base import KVCaches, KVConnectorWorker
from raylm.runner.kv_transfer.factory import make_connector_worker
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core_outputs import (
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    merge_kv_connector_outputs,
)

if TYPE_CHECKING:
    from raylm.runner.attention.paged_attention import Attention


@dataclass
class KVConnectorSteps:
    connector: KVConnectorWorker
    reports: bool  # the last PP stage: its outputs go to the EngineCore
    _kept: KVConnectorOutput | None = None

    @classmethod
    def make(cls, config: EngineConfig, ctx: ParallelContext) -> KVConnectorSteps | None:
        connector = make_connector_worker(config, ctx)
        return None if connector is None else cls(connector, ctx.is_last_pp_rank)

    def bind(self, kv_caches: KVCaches, attention_layers: Sequence[Attention]) -> None:
        self.connector.register_kv_caches(kv_caches)
        for i, attn in enumerate(attention_layers):
            attn.kv_connector, attn.layer_index = self.connector, i

    def begin(self, scheduler_output: SchedulerOutput) -> None:
        self.connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        self.connector.start_load_kv()

    def has_step_loads(self) -> bool:
        return self.connector.has_step_loads()

    def end(self, scheduler_output: SchedulerOutput, out: object) -> None:
        self.attach(out, self.connector.finish_step(idle=scheduler_output.is_empty))

    def attach(self, out: object, report: KVConnectorOutput | None = None) -> None:
        """The report (and any kept one) on ``out`` if it is a step's output, else kept."""
        report = merge_kv_connector_outputs(self._kept, report)
        if isinstance(out, (ModelRunnerOutput, AsyncModelRunnerOutput)):
            out.kv_connector_output, self._kept = report, None
        else:
            self._kept = report if self.reports else None

    def shutdown(self) -> None:
        self.connector.shutdown()
