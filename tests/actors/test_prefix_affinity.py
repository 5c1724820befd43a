"""Prefix-cache affinity without Ray: the block hashes, the per-engine mirror (longest match,
LRU capacity, age, engines joining and leaving), the routing rule, and the DP balancer that
applies it to ranks."""

from __future__ import annotations

import pytest

from raylm.actors.dp_coordinator import DPLoadBalancer
from raylm.actors.prefix_affinity import (
    ADAPTER_MATCH,
    LEAST_LOADED,
    MOST_FREE_KV,
    NO_PROMPT,
    PREFIX_MATCH,
    AdapterResidency,
    AffinityRule,
    Candidate,
    PrefixIndex,
    prompt_block_hashes,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_hashes_chain_over_full_blocks_and_a_salt_starts_its_own_chain():
    a = prompt_block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the last 2 tokens are no full block
    assert prompt_block_hashes(list(range(8)) + [99, 98, 97, 96], 4)[:2] == a
    assert prompt_block_hashes([0, 1, 2, 9] + list(range(4, 8)), 4)[1] != a[1]  # chained
    assert not set(prompt_block_hashes(list(range(10)), 4, "adapter")) & set(a)


def test_longest_match_per_engine_and_engines_that_leave_or_join():
    index = PrefixIndex()
    system = prompt_block_hashes(list(range(64)), 8)  # 8 blocks
    index.insert("A", system + prompt_block_hashes(list(range(64)) + [1] * 8, 8)[8:])
    index.insert("B", system[:3])
    request = prompt_block_hashes(list(range(64)) + [2] * 16, 8)
    assert index.match(request, ["A", "B", "C"]) == {"A": 8, "B": 3, "C": 0}
    index.remove("A")  # dead or drained: nothing it held is matched any more
    assert index.match(request, ["A", "B"]) == {"A": 0, "B": 3}
    index.sync(["B", "D"])  # D joins empty
    assert index.engines() == ["B", "D"] and index.num_blocks("D") == 0


def test_mirror_evicts_lru_blocks_beyond_the_engines_capacity_and_ages_out():
    clock = Clock()
    index = PrefixIndex(ttl_s=100.0, clock=clock)
    index.add("A", capacity=10)
    p1, p2 = (prompt_block_hashes([seed] * 48, 8) for seed in (1, 2))  # 6 blocks each
    index.insert("A", p1)
    clock.now = 1.0
    index.insert("A", p2)  # 12 > 10: p1's two least recently used blocks go
    assert index.num_blocks("A") == 10
    assert index.match(p1, ["A"]) == {"A": 0}  # its first block went first
    assert index.match(p2, ["A"]) == {"A": 6}
    clock.now = 60.0
    index.insert("A", p2[:2])  # used again: younger
    clock.now = 102.0  # p1's rest and p2's tail are older than ttl_s now
    assert index.match(p2, ["A"]) == {"A": 2} and index.num_blocks("A") == 2
    index.set_capacity("A", 1)
    assert index.num_blocks("A") == 1


def test_rule_load_first_then_longest_match_then_most_free_kv():
    rule = AffinityRule(imbalance_threshold=4, min_match_ratio=0.25, random_ties=False)
    balanced = [Candidate("A", 3, 0, 0.9), Candidate("B", 5, 8, 0.2), Candidate("C", 4, 2, 0.5)]
    assert rule.rank(balanced, 10) == (PREFIX_MATCH, ["B", "C", "A"])
    # A hot prefix overflowing B: the loads differ by more than 4, so B gives way.
    hot = [Candidate("A", 1, 0, 0.9), Candidate("B", 6, 8, 0.2), Candidate("C", 2, 2, 0.5)]
    assert rule.rank(hot, 10) == (LEAST_LOADED, ["A", "C", "B"])
    # Matches below a quarter of the prompt do not count: the most free KV wins.
    small = [Candidate("A", 3, 0, 0.4), Candidate("B", 3, 2, 0.2), Candidate("C", 5, 1, 0.9)]
    assert rule.rank(small, 10) == (MOST_FREE_KV, ["C", "A", "B"])
    # Nothing reported yet: the least loaded.
    unknown = [Candidate("A", 2), Candidate("B", 1)]
    assert rule.rank(unknown, 10) == (MOST_FREE_KV, ["B", "A"])
    with pytest.raises(ValueError, match="min_match_ratio"):
        AffinityRule(min_match_ratio=2)


def test_an_engine_holding_the_adapter_wins_after_the_prefix_and_before_free_kv():
    rule = AffinityRule(imbalance_threshold=4, min_match_ratio=0.25, random_ties=False)
    # No prefix worth having: the engine with the adapter, though another has more free KV.
    no_prefix = [Candidate("A", 3, 0, 0.9), Candidate("B", 3, 1, 0.2, holds_adapter=True)]
    assert rule.rank(no_prefix, 10) == (ADAPTER_MATCH, ["B", "A"])
    # A prefix match still comes first; load imbalance before both.
    prefix = [Candidate("A", 3, 8, 0.9), Candidate("B", 3, 0, 0.2, holds_adapter=True)]
    assert rule.rank(prefix, 10) == (PREFIX_MATCH, ["A", "B"])
    hot = [Candidate("A", 0, 0, 0.9), Candidate("B", 6, 0, 0.2, holds_adapter=True)]
    assert rule.rank(hot, 10) == (LEAST_LOADED, ["A", "B"])


def test_adapter_residency_keeps_each_engines_last_adapters_and_forgets_leavers():
    held = AdapterResidency(per_engine=2)
    for adapter in ("x", "y", "x", "z"):
        held.touch("A", adapter)
    assert [a for a in "xyz" if held.holds("A", a)] == ["x", "z"]  # y least recent: out
    assert not held.holds("A", None) and not held.holds("B", "x")
    held.sync(["B"])
    assert not held.holds("A", "x")
    off = AdapterResidency(per_engine=0)  # LoRA off: nothing is remembered
    off.touch("A", "x")
    assert not off.holds("A", "x")
    with pytest.raises(ValueError, match="per_engine"):
        AdapterResidency(-1)


def test_random_ties_spread_equal_candidates():
    rule = AffinityRule()
    firsts = {rule.rank([Candidate(e, 0) for e in "ABC"], 4)[1][0] for _ in range(64)}
    assert firsts == {"A", "B", "C"}


def test_dp_balancer_keeps_a_prefix_on_its_rank_and_spills_when_it_runs_hot():
    lb = DPLoadBalancer(2, imbalance_threshold=2)
    for rank in (0, 1):
        lb.set_kv_capacity(rank, 1000)
    shared = list(range(40))
    hashes = [prompt_block_hashes(shared + [i] * 8, 8) for i in range(8)]
    other = prompt_block_hashes([7] * 48, 8)
    assert lb.select("p0", hashes[0]) == 0  # nothing known: least loaded, lowest rank
    assert lb.select("o0", other) == 1  # no match: most free KV (unknown), least loaded
    assert lb.select("p1", hashes[1]) == 0  # the shared prefix is on rank 0
    assert lb.select("p2", hashes[2]) == 0
    # Rank 0 holds 3, rank 1 holds 1: within the threshold of 2, the prefix still wins.
    assert lb.select("p3", hashes[3]) == 0
    # Now 4 vs 1: least loaded, although rank 1 holds none of it.
    assert lb.select("p4", hashes[4]) == 1
    assert lb.decisions() == {PREFIX_MATCH: 3, LEAST_LOADED: 1, MOST_FREE_KV: 2, NO_PROMPT: 0,
                              ADAPTER_MATCH: 0}
    for rid in ("p0", "p1", "p2", "p3"):
        lb.finish(rid)
    # The prefix is on both ranks now; balanced load, so the match ties and load decides.
    assert lb.select("p5", hashes[5]) == 0
    assert lb.select("x", None) == 0  # no hashes (prefix caching off): least loaded
    assert lb.num_routed() == [6, 2] and lb.decisions()[NO_PROMPT] == 1


def test_dp_balancer_prefers_the_rank_with_more_free_kv_for_a_new_prefix():
    lb = DPLoadBalancer(2)
    lb.set_kv_usage(0, 0.8)
    lb.set_kv_usage(1, 0.1)
    assert lb.select("a", prompt_block_hashes([3] * 32, 8)) == 1
    assert lb.select("b", prompt_block_hashes([4] * 32, 8)) == 1  # 0 vs 1: still balanced
