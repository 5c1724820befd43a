"""Prefix-cache affinity: which engine (a Serve replica, a DP rank) most likely holds a
prompt's prefix in its KV cache, and the routing rule built on it (docs/architecture.md §14).

Neither Serve's request router nor the DP client can read an engine's block pool (the
engine loop thread owns it, §10), so each keeps a mirror: the block hashes of the prompts it
sent to each engine, least recently used first, at most the engine's KV blocks, each one
dropped after ``ttl_s`` without use. The hashes chain as the engine's do
(``scheduler/kv/kv_cache_utils.py``): a hash names its whole prefix, so the longest match of
a request on an engine is how far down the request's hashes that engine holds them all.

Pure Python (no Ray, no torch): the Serve router imports it in the ingress process.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from raylm.scheduler.kv.kv_cache_utils import NONE_HASH, hash_block_tokens

# The routing decisions, as the routers count them (raylm:router_requests{decision}).
PREFIX_MATCH = "prefix_match"  # load balanced, the longest match won
LEAST_LOADED = "least_loaded"  # load differed by more than the threshold: least loaded won
MOST_FREE_KV = "most_free_kv"  # load balanced, no match worth having: most free KV won
ADAPTER_MATCH = "adapter_match"  # load balanced, no prefix: an engine holding the LoRA won
NO_PROMPT = "no_prompt"  # the request's prompt could not be read: least loaded won
DECISIONS = (PREFIX_MATCH, LEAST_LOADED, MOST_FREE_KV, ADAPTER_MATCH, NO_PROMPT)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        salt: Hashable | None = None) -> list[int]:
    """The chained hashes of the prompt's full blocks. ``salt`` (a LoRA adapter's name)
    starts a chain of its own, as the engine keys an adapter's blocks: equal tokens under
    another salt share nothing. The values only need to agree with this process's other
    calls (each mirror hashes for itself), not with the engine's."""
    parent = NONE_HASH if salt is None else hash((NONE_HASH, salt))
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Per engine, the block hashes it was sent, LRU first. Not thread-safe: each owner
    (a router's event loop, the DP balancer under its lock) serialises its calls."""

    def __init__(self, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}.")
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: dict[Hashable, OrderedDict[int, float]] = {}
        self._capacity: dict[Hashable, int | None] = {}
        self._owners: dict[int, set[Hashable]] = {}

    def engines(self) -> list[Hashable]:
        return list(self._blocks)

    def num_blocks(self, engine: Hashable) -> int:
        return len(self._blocks.get(engine, ()))

    def add(self, engine: Hashable, capacity: int | None = None) -> None:
        """A new engine (a replica that joined): empty until requests are sent to it."""
        self._blocks.setdefault(engine, OrderedDict())
        self._capacity.setdefault(engine, capacity)

    def remove(self, engine: Hashable) -> None:
        """An engine that left (dead, drained): everything it held goes."""
        for h in self._blocks.pop(engine, {}):
            self._drop_owner(h, engine)
        self._capacity.pop(engine, None)

    def sync(self, engines: Iterable[Hashable]) -> None:
        """Make the engine set exactly ``engines`` (joins empty, leaves forgotten)."""
        keep = set(engines)
        for engine in [e for e in self._blocks if e not in keep]:
            self.remove(engine)
        for engine in keep:
            self.add(engine)

    def set_capacity(self, engine: Hashable, num_blocks: int | None) -> None:
        """The engine's KV pool in blocks: the mirror never holds more (LRU goes first)."""
        if engine in self._blocks:
            self._capacity[engine] = num_blocks
            self._trim(engine)

    def insert(self, engine: Hashable, hashes: Sequence[int]) -> None:
        """The engine was sent a prompt with these hashes: it holds them now, most
        recently used (as the engine's own LRU sees a hit or a fresh block)."""
        self.add(engine)
        lru, now = self._blocks[engine], self._clock()
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                self._owners.setdefault(h, set()).add(engine)
            lru[h] = now
        self._trim(engine)

    def match(self, hashes: Sequence[int], engines: Iterable[Hashable]) -> dict[Hashable, int]:
        """Per engine, how many leading blocks of ``hashes`` it holds."""
        counts = dict.fromkeys(engines, 0)
        for engine in counts:
            self._expire(engine)
        remaining = set(counts)
        for i, h in enumerate(hashes):
            remaining &= self._owners.get(h, set())
            if not remaining:
                break
            for engine in remaining:
                counts[engine] = i + 1
        return counts

    def _trim(self, engine: Hashable) -> None:
        lru, cap = self._blocks[engine], self._capacity.get(engine)
        while cap is not None and len(lru) > cap:
            h, _ = lru.popitem(last=False)
            self._drop_owner(h, engine)
        self._expire(engine)

    def _expire(self, engine: Hashable) -> None:
        lru = self._blocks.get(engine)
        oldest = self._clock() - self.ttl_s
        while lru and next(iter(lru.values())) < oldest:
            h, _ = lru.popitem(last=False)
            self._drop_owner(h, engine)

    def _drop_owner(self, h: int, engine: Hashable) -> None:
        owners = self._owners.get(h)
        if owners is not None:
            owners.discard(engine)
            if not owners:
                del self._owners[h]


class AdapterResidency:
    """Per engine, the LoRA adapters it was last sent requests for, at most ``per_engine``
    (its host-side LRU, max_cpu_loras), least recently used first: a request for an adapter
    goes where it is loaded already, so each adapter loads on one replica, not on each."""

    def __init__(self, per_engine: int) -> None:
        if per_engine < 0:
            raise ValueError(f"per_engine must be >= 0, got {per_engine!r}.")
        self.per_engine = per_engine
        self._held: dict[Hashable, OrderedDict[str, None]] = {}

    def holds(self, engine: Hashable, adapter: str | None) -> bool:
        return adapter is not None and adapter in self._held.get(engine, ())

    def touch(self, engine: Hashable, adapter: str | None) -> None:
        """``engine`` was sent a request for ``adapter``: it holds it, most recent."""
        if adapter is None or not self.per_engine:
            return
        held = self._held.setdefault(engine, OrderedDict())
        held[adapter] = None
        held.move_to_end(adapter)
        while len(held) > self.per_engine:
            held.popitem(last=False)

    def sync(self, engines: Iterable[Hashable]) -> None:
        """Forget the engines not in ``engines`` (a replica that left loaded nothing)."""
        keep = set(engines)
        for engine in [e for e in self._held if e not in keep]:
            del self._held[engine]


@dataclass(frozen=True)
class Candidate:
    """One engine as the rule sees it: its load (ongoing requests), how many of the
    request's blocks it holds, its free KV fraction (None: not reported yet), and whether
    it holds the request's LoRA adapter."""

    engine: Hashable
    load: float
    matched_blocks: int = 0
    free_kv: float | None = None
    holds_adapter: bool = False


@dataclass(frozen=True)
class AffinityRule:
    """Load first: when the candidates' loads differ by more than ``imbalance_threshold``
    the least loaded wins (a hot prefix spills over). Otherwise the longest match wins,
    if it covers at least ``min_match_ratio`` of the prompt's blocks (a chat template's
    first block alone is no reason to pick an engine); otherwise an engine that holds the
    request's LoRA adapter; otherwise the most free KV (in steps of ``free_kv_step``). Later
    keys break ties: load, then free KV, then match; then a random order with
    ``random_ties`` (the Serve router), else the candidates' own order (DP ranks)."""

    imbalance_threshold: float = 8.0
    min_match_ratio: float = 0.1
    random_ties: bool = True
    # Free KV is compared in steps of this share of the pool: it is reported a moment
    # late, and a few blocks' difference is no reason to pile new prompts on one engine.
    free_kv_step: float = 0.1

    def __post_init__(self) -> None:
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold!r}.")
        if not 0 <= self.min_match_ratio <= 1:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {self.min_match_ratio!r}.")
        if not 0 < self.free_kv_step <= 1:
            raise ValueError(f"free_kv_step must be in (0, 1], got {self.free_kv_step!r}.")

    def rank(self, candidates: Sequence[Candidate], num_blocks: int
             ) -> tuple[str, list[Hashable]]:
        """(decision, engines best first) for a prompt of ``num_blocks`` full blocks."""
        if not candidates:
            return LEAST_LOADED, []
        order = list(range(len(candidates)))
        if self.random_ties:
            random.shuffle(order)
        tie = {id(c): order[i] for i, c in enumerate(candidates)}

        def free(c: Candidate) -> float:
            return -1.0 if c.free_kv is None else math.floor(c.free_kv / self.free_kv_step + 1e-9)

        loads = [c.load for c in candidates]
        best = max(c.matched_blocks for c in candidates)
        if max(loads) - min(loads) > self.imbalance_threshold:
            decision = LEAST_LOADED
            ranked = sorted(candidates, key=lambda c: (c.load, -free(c), -c.matched_blocks,
                                                       tie[id(c)]))
        elif num_blocks and best and best >= self.min_match_ratio * num_blocks:
            decision = PREFIX_MATCH
            ranked = sorted(candidates, key=lambda c: (-c.matched_blocks, c.load, -free(c),
                                                       tie[id(c)]))
        elif any(c.holds_adapter for c in candidates):
            decision = ADAPTER_MATCH
            ranked = sorted(candidates, key=lambda c: (not c.holds_adapter, c.load, -free(c),
                                                       tie[id(c)]))
        else:
            decision = MOST_FREE_KV
            ranked = sorted(candidates, key=lambda c: (-free(c), c.load, -c.matched_blocks,
                                                       tie[id(c)]))
        return decision, [c.engine for c in ranked]
