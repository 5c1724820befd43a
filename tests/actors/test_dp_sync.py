"""The DP Gloo group (raylm.parallel.dp_sync): rendezvous published by rank 0, small int
all-reduces, bounded failures. Ranks run as threads: the group is stateless (not the
default torch.distributed group), so several live in one process.

(It tests raylm.parallel; it lives here with the other DP tests.)
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

from raylm.parallel.dp_sync import DPSyncGroup
from raylm.parallel.rendezvous import StoreRendezvous


def _join_all(dp_size: int, timeout_s: float = 20.0, ranks=None) -> list[DPSyncGroup]:
    rdv = StoreRendezvous.publish("127.0.0.1", dp_size, timeout_s=timeout_s)
    ranks = list(range(dp_size)) if ranks is None else ranks
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [pool.submit(DPSyncGroup.join, host=rdv.host, port=rdv.port, dp_rank=r,
                               dp_size=dp_size, timeout_s=timeout_s,
                               rendezvous=rdv if r == 0 else None) for r in ranks]
        return [f.result() for f in futures]


def _all(groups, fn_name, values_by_rank):
    with ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(getattr(g, fn_name), values_by_rank[g.dp_rank]) for g in groups]
        return [f.result(timeout=30) for f in futures]


def test_three_ranks_all_reduce_max_and_sum():
    groups = _join_all(3)
    values = {0: [0, 5, -2], 1: [1, 0, -2], 2: [0, 3, -7]}
    assert _all(groups, "all_reduce_max", values) == [[1, 5, -2]] * 3
    assert _all(groups, "all_reduce_sum", values) == [[1, 8, -11]] * 3
    # Many small rounds, as the DP loop does: results never mix rounds.
    for i in range(20):
        vals = {r: [i * r, -i] for r in range(3)}
        assert _all(groups, "all_reduce_max", vals) == [[2 * i, -i]] * 3


def test_peer_missing_from_a_collective_raises_within_the_timeout():
    groups = _join_all(2, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="DP all-reduce failed on DP rank 0 of 2"):
        groups[0].all_reduce_max([1])


def test_peer_missing_from_the_rendezvous_times_out():
    with pytest.raises(TimeoutError, match="DP rank 1 of 2"):
        rdv = StoreRendezvous.publish("127.0.0.1", 2, timeout_s=1.0)
        DPSyncGroup.join(host=rdv.host, port=rdv.port, dp_rank=1, dp_size=2, timeout_s=1.0)


def test_dp_loops_in_lockstep_over_real_gloo():
    """The DP loop over the real Gloo all-reduce: two ranks, a wave, pause, a second wave."""
    from raylm.scheduler.core.dp_loop import DPEngineCoreLoop, WaveRecord
    from raylm.scheduler.core_outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason

    class FakeRequest(NamedTuple):  # what the loop reads of a request: its id
        request_id: str
        num_steps: int

    class Core:
        def __init__(self):
            self.left: dict[str, int] = {}
            self.executor = None

        def add_request(self, r):
            self.left[r[0]] = r[1]

        def abort_requests(self, ids):
            pass

        def has_work(self):
            return bool(self.left)

        def step_fn(self):
            outs = []
            for rid in list(self.left):
                self.left[rid] -= 1
                done = self.left[rid] == 0
                if done:
                    del self.left[rid]
                outs.append(EngineCoreOutput(rid, [1], finish_reason=FinishReason.LENGTH if done else None))
            return EngineCoreOutputs(outputs=outs), bool(outs)

        def shutdown(self):
            pass

    groups = _join_all(2)
    loops: list[DPEngineCoreLoop] = []
    lock = threading.Lock()

    def start_wave(frm, wave):
        with lock:
            for r, loop in enumerate(loops):
                if r != frm:
                    loop.start_wave(wave)

    for g in groups:
        loops.append(DPEngineCoreLoop(Core(), dp_rank=g.dp_rank, dp_size=2,
                                      all_reduce=g.all_reduce_max, sync_interval=2,
                                      request_start_wave=lambda w, r=g.dp_rank: start_wave(r, w)))
    try:
        for wave, (rank, rid) in enumerate([(0, "a"), (1, "b")]):
            loops[rank].add_request(FakeRequest(rid, 3))
            finished = False
            while not finished:
                out = loops[rank].get_output(timeout=20)
                assert out is not None
                finished = any(o.finished for o in out.outputs)
            for _ in range(2000):
                if all(loop.get_dp_stats().num_waves_completed == wave + 1 for loop in loops):
                    break
                threading.Event().wait(0.01)
        # Collectives at step 0 (work left) and step 2 (the third step finished it).
        expected = [WaveRecord(0, 3, 2), WaveRecord(1, 3, 2)]
        assert [list(loop.wave_log) for loop in loops] == [expected, expected]
    finally:
        for loop in loops:
            loop.shutdown()
