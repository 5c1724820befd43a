"""DP coordination: prefix-aware routing on the driver, wave starts in a Ray actor.

``DPLoadBalancer`` sits in the client, on the request path, and learns of finishes (and the
ranks' KV usage) from the outputs the client reads anyway, so routing costs no Ray call. ``DPCoordinator`` is an
actor because the ranks call it: a paused rank that gets work starts the next wave itself
and asks it to start the wave on the others. It serves one call at a time, so its
check-and-set needs no lock; ranks ignore starts of waves they already began.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from raylm.actors.prefix_affinity import (
    DECISIONS,
    NO_PROMPT,
    AffinityRule,
    Candidate,
    PrefixIndex,
)
from raylm.scheduler.config.validation import check_at_least

logger = logging.getLogger(__name__)


class DPLoadBalancer:
    """Routes each new request to a DP rank: with the prompt's block hashes, by the
    prefix-affinity rule (actors/prefix_affinity.py: least loaded when the ranks'
    unfinished counts differ by more than ``imbalance_threshold``, else the rank holding
    the longest prefix, else the one with the most free KV); without them, to the
    least-loaded rank. The threshold is low: ranks step together in waves, so a wave
    lasts as long as its busiest rank. Thread-safe."""

    def __init__(self, dp_size: int, *, imbalance_threshold: float = 2.0,
                 min_match_ratio: float = 0.1, ttl_s: float = 600.0) -> None:
        check_at_least("dp_size", dp_size)
        self.dp_size = dp_size
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}
        self._unfinished = [0] * dp_size
        self._routed = [0] * dp_size
        self._rule = AffinityRule(imbalance_threshold, min_match_ratio, random_ties=False)
        self._index = PrefixIndex(ttl_s)
        self._index.sync(range(dp_size))
        self._kv_usage: list[float | None] = [None] * dp_size
        self._decisions = dict.fromkeys(DECISIONS, 0)

    def set_kv_capacity(self, rank: int, num_blocks: int) -> None:
        """Rank ``rank``'s KV pool, in blocks: its prefix mirror holds at most that many."""
        with self._lock:
            self._index.set_capacity(rank, num_blocks)

    def set_kv_usage(self, rank: int, usage: float) -> None:
        """The rank's latest KV usage (0-1), from the stats its outputs carry."""
        self._kv_usage[rank] = usage

    def select(self, request_id: str, block_hashes: list[int] | None = None) -> int:
        """Pick the rank for a new request and count it there until ``finish``."""
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request_id {request_id!r} is already being served "
                                 f"(on DP rank {self._owner[request_id]}).")
            if block_hashes is None:
                rank = min(range(self.dp_size), key=lambda r: (self._unfinished[r], r))
                self._decisions[NO_PROMPT] += 1
            else:
                matched = self._index.match(block_hashes, range(self.dp_size))
                free = [None if u is None else 1.0 - u for u in self._kv_usage]
                decision, ranked = self._rule.rank(
                    [Candidate(r, self._unfinished[r], matched[r], free[r])
                     for r in range(self.dp_size)], len(block_hashes))
                chosen = ranked[0]
                assert isinstance(chosen, int), ranked
                rank = chosen
                self._index.insert(rank, block_hashes)
                self._decisions[decision] += 1
            self._owner[request_id] = rank
            self._unfinished[rank] += 1
            self._routed[rank] += 1
            return rank

    def finish(self, request_id: str) -> int | None:
        """The request finished (or was rejected); its rank, or None if unknown."""
        with self._lock:
            rank = self._owner.pop(request_id, None)
            if rank is not None:
                self._unfinished[rank] -= 1
            return rank

    def owner(self, request_id: str) -> int | None:
        with self._lock:
            return self._owner.get(request_id)

    def num_unfinished(self) -> list[int]:
        with self._lock:
            return list(self._unfinished)

    def num_routed(self) -> list[int]:
        """Requests ever routed to each rank."""
        with self._lock:
            return list(self._routed)

    def decisions(self) -> dict[str, int]:
        """How many requests each rule decided (actors/prefix_affinity.py DECISIONS)."""
        with self._lock:
            return dict(self._decisions)


class DPWaveCoordinator:
    """Broadcasts wave starts to the DP ranks and counts waves (rank 0 reports the ends).
    Plain class (unit-tested with fake handles); ``DPCoordinator`` is its Ray actor."""

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self.ranks: list[Any] = []
        self.last_started_wave = -1
        self.num_waves_completed = 0
        self.start_requests = [0] * dp_size  # wave starts asked for, per rank
        self.num_broadcasts = 0

    def register_ranks(self, ranks: list[Any]) -> None:
        if len(ranks) != self.dp_size:
            raise ValueError(f"expected {self.dp_size} DP rank handles, got {len(ranks)}.")
        self.ranks = list(ranks)

    def start_wave(self, wave: int, from_rank: int) -> None:
        """``from_rank`` started ``wave`` on its own work: bring the other ranks in."""
        self.start_requests[from_rank] += 1
        if wave <= self.last_started_wave:
            return  # another rank asked first; its broadcast reached everyone
        self.last_started_wave = wave
        self.num_broadcasts += 1
        for rank, handle in enumerate(self.ranks):
            if rank != from_rank:
                # Fire and forget: a rank that never hears of the wave shows up as a
                # bounded DP all-reduce timeout on the others, not as a hang here.
                handle.start_wave.remote(wave)

    def wave_complete(self, wave: int) -> None:
        self.num_waves_completed = max(self.num_waves_completed, wave + 1)

    def get_state(self) -> dict[str, Any]:
        return {"last_started_wave": self.last_started_wave,
                "num_waves_completed": self.num_waves_completed,
                "start_requests": list(self.start_requests),
                "num_broadcasts": self.num_broadcasts}


# One call at a time (no max_concurrency): start_wave's check-and-set needs no lock.
DPCoordinator = ray.remote(num_cpus=0)(DPWaveCoordinator)
