"""Worker thread setup: torch.set_num_threads is called only to change the count (on
torch 2.13 CPU the call itself slows the sdpa kernel ~2.5x from then on)."""

from __future__ import annotations

import torch

from raylm.runner import worker as worker_mod


def test_set_intra_op_threads_only_calls_torch_to_change_the_count(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(worker_mod.torch, "set_num_threads", calls.append)
    current = torch.get_num_threads()
    worker_mod.set_intra_op_threads(current)
    assert calls == []
    worker_mod.set_intra_op_threads(current + 1)
    assert calls == [current + 1]
