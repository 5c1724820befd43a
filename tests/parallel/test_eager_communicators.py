"""NCCL communicators are created at start, in one order on every rank: the default group
bound to the rank's device (``device_id=``), then one warm-up collective per group and one
p2p hop along the PP chain. Checked by recording the torch.distributed calls a rank makes
(no NCCL here); the gloo worlds of test_distributed.py run the same code for real."""

from __future__ import annotations

import pytest
import torch

from raylm.parallel import distributed


class _Recorder:
    def __init__(self, monkeypatch, rank: int) -> None:
        self.calls: list[tuple] = []
        self.initialized = False
        d = distributed.dist
        monkeypatch.setattr(distributed, "pick_device",
                            lambda local_rank, expect_cuda=False: (torch.device("cpu"), "nccl"))
        monkeypatch.setattr(d, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(d, "init_process_group", self.init_process_group)
        monkeypatch.setattr(distributed, "_rendezvous_store", lambda *a: "store")
        monkeypatch.setattr(d, "new_group", lambda ranks, **kw: ("group", tuple(ranks)))
        monkeypatch.setattr(d, "get_rank", lambda: rank)
        monkeypatch.setattr(d, "get_backend", lambda *a: "nccl")
        monkeypatch.setattr(d, "all_reduce", lambda t, group: self.calls.append(("all_reduce", group[1])))
        monkeypatch.setattr(d, "send", lambda t, dst, group: self.calls.append(("send", dst)))
        monkeypatch.setattr(d, "recv", lambda t, src, group: self.calls.append(("recv", src)))

    def init_process_group(self, **kwargs) -> None:
        self.initialized = True
        self.calls.append(("init", kwargs.get("device_id")))


@pytest.mark.parametrize("rank,expected", [
    (0, [("init", torch.device("cpu")), ("all_reduce", (0, 1)), ("all_reduce", (0, 2)),
         ("send", 2), ("all_reduce", (0, 2))]),
    (3, [("init", torch.device("cpu")), ("all_reduce", (2, 3)), ("all_reduce", (1, 3)),
         ("recv", 1), ("all_reduce", (1, 3))]),
])
def test_nccl_ranks_create_every_communicator_at_start_in_one_order(monkeypatch, rank, expected):
    rec = _Recorder(monkeypatch, rank)
    ctx = distributed.init_distributed_environment(
        world_size=4, rank=rank, distributed_init_method="tcp://127.0.0.1:1",
        tensor_parallel_size=2, pipeline_parallel_size=2)
    distributed.new_pp_broadcast_group(ctx)  # the sampled-id broadcast group, warmed too
    assert rec.calls == expected


def test_gloo_binds_no_device():
    assert distributed.process_group_kwargs("gloo", torch.device("cpu")) == {}
    assert distributed.process_group_kwargs("nccl", torch.device("cuda", 1)) == {
        "device_id": torch.device("cuda", 1)}
