"""The Executor protocol: the EngineCore's only view of the workers.

Implementations: ``raylm.runner.uniproc_executor.UniProcExecutor`` (in process) and
``raylm.actors.ray_executor.RayExecutor`` (Ray worker actors). Tests use fakes.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from raylm.scheduler.core_outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from raylm.scheduler.structured.manager import GrammarOutput


class EngineDeadError(RuntimeError):
    """The engine (an EngineCore or a worker) died; carries the root cause in its message."""

    # An EngineCore's final ABORT outputs (EngineCore._fail), their only copy.
    outputs: EngineCoreOutputs | None = None


@runtime_checkable
class Executor(Protocol):
    # How many steps may be in flight is EngineConfig.max_concurrent_batches (one fact,
    # read by the EngineCore); an executor only says whether it can overlap at all.
    #: Whether ``execute_model(non_block=True)`` really returns before the step completes.
    supports_async_scheduling: bool

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit (the minimum over ranks)."""
        ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Enqueue one step. Steps execute in submission order; empty steps included
        (they carry frees). With ``non_block`` it returns a Future at once; the result is
        the output of TP rank 0 of the last PP stage. Raises EngineDeadError.

        A step with ``structured_output_request_ids`` runs only its forward here (its
        result is None, or with speculative decoding the DraftTokenIds of those requests);
        its sampling waits for the ``sample_tokens`` that follows it."""
        ...

    def sample_tokens(
        self, grammar_output: GrammarOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Sample the latest step whose sampling was deferred, under the grammar bitmask
        (rows for ``structured_output_request_ids``; the last PP stage uses it). Steps and
        samplings execute in submission order; the result is that step's output."""
        ...

    def check_health(self) -> None:
        """Raise EngineDeadError if any worker is dead."""
        ...

    def device_info(self) -> dict[str, Any]:
        """What the ranks run on: ``kind`` (cuda, cpu), ``name``, ``count`` (ranks)."""
        ...

    def expert_load(self) -> dict[int, dict[int, int]]:
        """Mixtures of experts: per sparse layer, tokens routed to each expert so far (every
        stage's layers, every rank's experts); empty for a dense model."""
        ...

    def shutdown(self) -> None: ...
