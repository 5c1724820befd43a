"""bench/overlap.py's simulated device must stay a faithful executor: every token of the
workload comes back, in both device models, sync and async, so the figures it prints
measure the real Scheduler and EngineCore (the timings themselves are the bench's job)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "overlap.py")


@pytest.fixture(scope="module")
def overlap():
    spec = importlib.util.spec_from_file_location("overlap_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("model", ["event", "thread"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_token_comes_back(overlap, model, async_scheduling):
    workload = overlap.Workload.make(12, seed=3)
    result = overlap.run(workload, async_scheduling, t_device=50e-6, model=model)
    assert result.generated == sum(workload.max_tokens)
    whole, steady = result.whole, result.steady
    # A step yields at most one token per request: the longest output needs that many.
    assert whole.steps >= max(workload.max_tokens)
    # The steady state ends once the last waiting request is admitted, long before the end.
    assert 0 < steady.steps < whole.steps
    assert steady.wall_s < whole.wall_s and steady.cpu_s <= whole.cpu_s
    # The device clock: no span can beat t_device per step it counts, including any step
    # still in flight when the span was taken.
    for span in (steady, whole):
        assert span.wall_s >= span.steps * 50e-6


def test_unknown_device_model_is_rejected(overlap):
    with pytest.raises(ValueError, match="'gpu'"):
        overlap.SimulatedDevice(1e-4, model="gpu")
