"""Prefix caching of recurrent states (vLLM's ``mamba_cache_mode="align"``): snapshots of a
hybrid model's state at block boundaries, indexed by the hash of the block they end.

A state layer's state after position p is one tensor whatever p, so a prefix hit of L
blocks needs, beside the attention layers' L blocks, the state after token L x block_size
- 1. The workers keep ``num_snapshots`` snapshot slots beside the requests' state slots
(runner/state_cache.py); this index, on the scheduler, decides which slot holds which
state:

- A step whose request ends a prefill chunk at a block boundary (the scheduler cuts
  prefill chunks there, the prompt's last full block included) saves the state into a
  slot taken now (a free one, else the least recently used): ``reserve``. The workers copy
  it after the step's forward, so the step's own reads come first.
- The slot is indexed when that step has returned (``on_step_processed``), as KV blocks
  are cached only once settled; until then no request can hit it.
- A waiting request's hit is the longest KV hit that ends where a snapshot is
  (``longest_hit``); its first step reads its state from that slot. Steps run in order on
  the workers, so a slot reserved for a later save is overwritten only after it is read.
"""

from __future__ import annotations

from collections import OrderedDict

from raylm.scheduler.config.validation import check_at_least


class StateSnapshots:
    def __init__(self, num_snapshots: int) -> None:
        check_at_least("num_state_snapshots", num_snapshots)
        self.num_snapshots = num_snapshots
        # Indexed snapshots, least recently used first: block hash -> slot.
        self._index: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(num_snapshots - 1, -1, -1))  # pop() hands out 0 first
        # Saves of steps in flight: step id -> [(block hash, slot)].
        self._pending: dict[int, list[tuple[int, int]]] = {}
        self._pending_hashes: set[int] = set()
        self.num_saved = 0  # snapshots indexed so far (read by the tests)

    def lookup(self, block_hash: int) -> int | None:
        """The slot holding the state at the end of the block with this hash (marked
        recently used), or None."""
        slot = self._index.get(block_hash)
        if slot is not None:
            self._index.move_to_end(block_hash)
        return slot

    def longest_hit(self, block_hashes: list[int], num_hit_blocks: int) -> tuple[int, int]:
        """The longest hit of at most ``num_hit_blocks`` blocks that ends at a snapshot:
        (its block count, the snapshot's slot); (0, -1) when there is none."""
        for n in range(num_hit_blocks, 0, -1):
            slot = self.lookup(block_hashes[n - 1])
            if slot is not None:
                return n, slot
        return 0, -1

    def wants(self, block_hash: int) -> bool:
        """Whether a save for this block is still useful (not indexed, not being saved)."""
        return block_hash not in self._index and block_hash not in self._pending_hashes

    def reserve(self, step_id: int, block_hash: int) -> int:
        """A slot for step ``step_id`` to save the state ending this block into."""
        if self._free:
            slot = self._free.pop()
        elif self._index:
            _, slot = self._index.popitem(last=False)
        else:
            return -1  # every slot is being written by a step in flight
        self._pending.setdefault(step_id, []).append((block_hash, slot))
        self._pending_hashes.add(block_hash)
        return slot

    def on_step_processed(self, step_id: int) -> None:
        """Saves of step ``step_id`` and every earlier one are on the workers: index them."""
        for step in [s for s in self._pending if s <= step_id]:
            for block_hash, slot in self._pending.pop(step):
                self._pending_hashes.discard(block_hash)
                self._index[block_hash] = slot
                self.num_saved += 1

    def check_integrity(self) -> None:
        pending = [slot for saves in self._pending.values() for _, slot in saves]
        slots = list(self._index.values()) + self._free + pending
        assert sorted(slots) == list(range(self.num_snapshots)), (
            f"snapshot slots lost or doubled: indexed {list(self._index.values())}, "
            f"free {self._free}, pending {pending}")
