"""DP routing and wave coordination without Ray: least-loaded choice, finishes, duplicate
ids; wave starts deduplicated and broadcast to every rank but the asker; metric merging."""

from __future__ import annotations

import pytest

from raylm.actors.dp_coordinator import DPLoadBalancer, DPWaveCoordinator
from raylm.actors.ray_engine_core_client import merge_metrics, merge_scheduler_stats
from raylm.scheduler.core_outputs import SchedulerStats


def test_least_loaded_routing_with_lowest_rank_on_ties():
    lb = DPLoadBalancer(3)
    assert [lb.select(f"r{i}") for i in range(4)] == [0, 1, 2, 0]
    assert lb.num_unfinished() == [2, 1, 1]
    assert lb.finish("r1") == 1 and lb.finish("r2") == 2
    assert lb.select("r4") == 1  # ranks 1 and 2 hold none now: the lower one
    assert lb.select("r5") == 2
    assert lb.owner("r5") == 2 and lb.owner("r1") is None
    assert lb.finish("r1") is None  # a second finish (abort after finish) is a no-op
    assert lb.num_unfinished() == [2, 1, 1] and lb.num_routed() == [2, 2, 2]


def test_uneven_load_goes_to_the_idle_rank():
    lb = DPLoadBalancer(2)
    assert lb.select("long") == 0
    for i in range(5):  # each short one finishes before the next arrives
        assert lb.select(f"s{i}") == 1
        lb.finish(f"s{i}")
    assert lb.num_routed() == [1, 5] and lb.num_unfinished() == [1, 0]


def test_duplicate_request_id_and_bad_size_are_value_errors():
    lb = DPLoadBalancer(2)
    lb.select("a")
    with pytest.raises(ValueError, match="'a' is already being served"):
        lb.select("a")
    with pytest.raises(ValueError, match="dp_size"):
        DPLoadBalancer(0)


class _Method:
    def __init__(self, log, rank):
        self.log, self.rank = log, rank

    def remote(self, wave):
        self.log.append((self.rank, wave))


class _FakeRank:
    def __init__(self, log, rank):
        self.start_wave = _Method(log, rank)


def test_wave_start_is_broadcast_once_to_the_other_ranks():
    log: list[tuple[int, int]] = []
    coord = DPWaveCoordinator(3)
    coord.register_ranks([_FakeRank(log, r) for r in range(3)])
    coord.start_wave(0, from_rank=1)
    assert log == [(0, 0), (2, 0)]
    coord.start_wave(0, from_rank=2)  # a second rank also had work for wave 0
    coord.start_wave(0, from_rank=0)
    assert log == [(0, 0), (2, 0)]
    coord.wave_complete(0)
    coord.start_wave(1, from_rank=0)
    assert log[2:] == [(1, 1), (2, 1)]
    assert coord.get_state() == {"last_started_wave": 1, "num_waves_completed": 1,
                                 "start_requests": [2, 1, 1], "num_broadcasts": 2}
    with pytest.raises(ValueError, match="expected 3 DP rank handles"):
        coord.register_ranks([])


def test_metrics_are_summed_kv_usage_averaged_per_rank_kept():
    a = {"raylm:request_success": 3, "raylm:kv_cache_usage_perc": 0.5, "dp": {"x": 1}}
    b = {"raylm:request_success": 4, "raylm:kv_cache_usage_perc": 0.1, "dp": {"x": 2}}
    merged = merge_metrics([a, b])
    assert merged["raylm:request_success"] == 7
    assert merged["raylm:kv_cache_usage_perc"] == pytest.approx(0.3)
    assert merged["dp_ranks"] == [a, b] and "dp" not in merged
    s = merge_scheduler_stats([SchedulerStats(2, 1, 0.2, 1, 10, 5),
                               SchedulerStats(1, 0, 0.4, 0, 6, 1)])
    assert s == SchedulerStats(3, 1, pytest.approx(0.3), 1, 16, 6)
