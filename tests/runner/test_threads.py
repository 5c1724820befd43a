"""Worker thread setup: torch.set_num_threads is called only to change the count (on
torch 2.13 CPU the call itself slows the sdpa kernel ~2.5x from then on)."""

from __future__ import annotations

import pytest
import torch

from raylm.runner import cpu_budget
from raylm.runner import worker as worker_mod


def test_set_intra_op_threads_only_calls_torch_to_change_the_count(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(worker_mod.torch, "set_num_threads", calls.append)
    current = torch.get_num_threads()
    worker_mod.set_intra_op_threads(current)
    assert calls == []
    worker_mod.set_intra_op_threads(current + 1)
    assert calls == [current + 1]


def test_default_threads_follow_the_override_else_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("RAYLM_NUM_THREADS", raising=False)
    monkeypatch.setattr(worker_mod.os, "sched_getaffinity", lambda pid: {0, 2, 5})
    monkeypatch.setattr(cpu_budget, "cgroup_cpu_quota", lambda: None)
    assert worker_mod.default_intra_op_threads() == 3  # the cpuset, not os.cpu_count()
    monkeypatch.setattr(cpu_budget, "cgroup_cpu_quota", lambda: 2.0)
    assert worker_mod.default_intra_op_threads() == 2  # a CPU limit caps it
    monkeypatch.setenv("RAYLM_NUM_THREADS", "7")
    assert worker_mod.default_intra_op_threads() == 7


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_thread_override_is_a_value_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("RAYLM_NUM_THREADS", value)
    with pytest.raises(ValueError, match=f"RAYLM_NUM_THREADS.*{value!r}"):
        worker_mod.default_intra_op_threads()
