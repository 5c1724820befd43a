"""Drive an EngineCore from the test's thread (no loop thread): step until it is idle."""

from __future__ import annotations

from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core_outputs import EngineCoreOutput


def run_until_idle(core: EngineCore, max_steps: int = 1_000_000) -> list[EngineCoreOutput]:
    """Every output, in order, until nothing is left; raises if still busy after
    ``max_steps`` steps."""
    outputs: list[EngineCoreOutput] = []
    for _ in range(max_steps):
        if not core.has_work():
            return outputs
        step_outputs, _ = core.step_fn()
        if step_outputs is not None:
            outputs.extend(step_outputs.outputs)
    raise RuntimeError(f"engine still busy after {max_steps} steps")
