"""torch.distributed bootstrap: rank layout, group memberships, gloo all-reduce, timeouts.

Each case spawns real processes (one rank each) that rendezvous over TCP on 127.0.0.1.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback

import pytest

from raylm.parallel.distributed import pp_group_ranks, tp_group_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, tp: int, pp: int, init: str, timeout_s: float,
               results) -> None:
    try:
        import torch
        import torch.distributed as dist

        from raylm.parallel.distributed import init_distributed_environment

        torch.set_num_threads(1)
        ctx = init_distributed_environment(
            world_size=world, rank=rank, distributed_init_method=init,
            tensor_parallel_size=tp, pipeline_parallel_size=pp, timeout_s=timeout_s)
        out = {"rank": rank, "tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank,
               "ctx_rank": ctx.rank, "device": str(ctx.device)}
        for name, group in (("tp", ctx.tp_group), ("pp", ctx.pp_group)):
            if group is None:
                out[f"{name}_members"] = None
                continue
            out[f"{name}_members"] = dist.get_process_group_ranks(group)
            x = torch.tensor([float(rank + 1)])
            dist.all_reduce(x, group=group)
            out[f"{name}_sum"] = x.item()
        results.put(out)
        dist.destroy_process_group()
    except BaseException as e:
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}",
                     "tb": traceback.format_exc()})
    finally:
        results.close()
        results.join_thread()  # flush the queue before skipping teardown
        # Skip interpreter teardown: a failed TCPStore can abort during it.
        os._exit(0)


def _run_world(world: int, tp: int, pp: int, ranks: list[int] | None = None,
               timeout_s: float = 60.0) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, tp, pp, init, timeout_s, results))
             for r in (ranks if ranks is not None else range(world))]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        item = results.get(timeout=timeout_s + 90)
        got[item["rank"]] = item
    for p in procs:
        p.join(timeout=30)
    return got


def test_group_rank_layout_matches_vllm():
    assert tp_group_ranks(2, 2) == [[0, 1], [2, 3]]
    assert pp_group_ranks(2, 2) == [[0, 2], [1, 3]]
    assert tp_group_ranks(4, 1) == [[0, 1, 2, 3]]
    assert pp_group_ranks(1, 3) == [[0, 1, 2]]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_two_ranks_form_groups_and_all_reduce(tp, pp):
    got = _run_world(2, tp, pp)
    for rank in (0, 1):
        r = got[rank]
        assert "error" not in r, r.get("tb")
        assert r["device"] == "cpu"
        assert (r["tp_rank"], r["pp_rank"]) == (rank % tp, rank // tp)
        assert r["ctx_rank"] == rank
        if tp == 2:
            assert r["tp_members"] == [0, 1] and r["pp_members"] is None
            assert r["tp_sum"] == 3.0
        else:
            assert r["pp_members"] == [0, 1] and r["tp_members"] is None
            assert r["pp_sum"] == 3.0


def test_tp2_pp2_four_ranks():
    got = _run_world(4, 2, 2)
    for rank in range(4):
        r = got[rank]
        assert "error" not in r, r.get("tb")
        stage, idx = rank // 2, rank % 2
        assert (r["tp_rank"], r["pp_rank"]) == (idx, stage)
        assert r["tp_members"] == [2 * stage, 2 * stage + 1]
        assert r["pp_members"] == [idx, idx + 2]
        assert r["tp_sum"] == float(sum(m + 1 for m in r["tp_members"]))
        assert r["pp_sum"] == float(sum(m + 1 for m in r["pp_members"]))


@pytest.mark.parametrize("present_rank", [0, 1])
def test_missing_peer_times_out_with_clear_error(present_rank):
    got = _run_world(2, 2, 1, ranks=[present_rank], timeout_s=2.0)
    err = got[present_rank].get("error")
    assert err is not None, "a rank alone in a world of 2 must not succeed"
    assert err.startswith("TimeoutError"), err
    assert f"rank {present_rank} of world_size 2" in err
    assert "tcp://127.0.0.1:" in err


def test_bad_sizes_raise_value_error():
    from raylm.parallel.distributed import init_distributed_environment

    with pytest.raises(ValueError, match="world_size"):
        init_distributed_environment(world_size=3, rank=0, distributed_init_method="tcp://a:1",
                                     tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rank"):
        init_distributed_environment(world_size=2, rank=2, distributed_init_method="tcp://a:1",
                                     tensor_parallel_size=2)
    with pytest.raises(ValueError, match="distributed_init_method"):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method="nowhere",
                                     tensor_parallel_size=1)
