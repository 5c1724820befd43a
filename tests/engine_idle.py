"""Read an LLM's metrics once its engine is idle."""

from __future__ import annotations

import time


def idle_metrics(llm, timeout_s: float = 30.0) -> dict:
    """The engine's metrics once no request runs and no KV block is in use, else the last
    ones read after ``timeout_s`` (for the test's assertion to show). A finished request's
    blocks are freed only when the steps still in flight for it return (async scheduling,
    pipeline stages), which may be after ``generate`` has returned every output."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = llm.get_metrics()
        idle = (metrics["raylm:num_requests_running"] == 0
                and metrics["raylm:kv_cache_usage_perc"] == 0.0)
        if idle or time.monotonic() > deadline:
            return metrics
        llm.llm_engine.step(timeout=0.1)
