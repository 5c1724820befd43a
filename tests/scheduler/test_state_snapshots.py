"""The recurrent states' snapshot index (scheduler/kv/state_snapshots.py): a save is a hit
only once its step has returned, the longest hit ends at a snapshot, the least recently
used snapshot is the one reused, and no slot is lost or doubled."""

from __future__ import annotations

import pytest

from raylm.scheduler.kv.state_snapshots import StateSnapshots


def test_a_save_is_found_only_after_its_step_returned():
    snaps = StateSnapshots(2)
    slot = snaps.reserve(step_id=3, block_hash=111)
    assert slot == 0 and not snaps.wants(111)  # being saved: not asked for twice
    assert snaps.lookup(111) is None
    snaps.on_step_processed(2)
    assert snaps.lookup(111) is None
    snaps.on_step_processed(3)
    assert snaps.lookup(111) == 0 and snaps.num_saved == 1
    snaps.check_integrity()


def test_the_longest_hit_ends_at_a_snapshot():
    snaps = StateSnapshots(4)
    hashes = [10, 20, 30, 40, 50]
    snaps.reserve(1, 20)
    snaps.reserve(1, 40)
    snaps.on_step_processed(1)
    assert snaps.longest_hit(hashes, 5) == (4, 1)  # blocks 0-3, the state after block 3
    assert snaps.longest_hit(hashes, 3) == (2, 0)  # the KV hit stops at 3 blocks
    assert snaps.longest_hit(hashes, 1) == (0, -1)
    snaps.check_integrity()


def test_the_least_recently_used_snapshot_is_reused_and_a_pending_one_never():
    snaps = StateSnapshots(2)
    snaps.reserve(1, 1)
    snaps.reserve(1, 2)
    assert snaps.reserve(2, 3) == -1  # both slots are being written by step 1
    snaps.on_step_processed(1)
    assert snaps.lookup(1) == 0  # 1 used last: 2 is the least recently used
    assert snaps.reserve(2, 3) == 1
    assert snaps.lookup(2) is None and snaps.lookup(1) == 0
    snaps.on_step_processed(2)
    assert snaps.lookup(3) == 1
    snaps.check_integrity()


def test_no_snapshot_slots_is_refused_by_name():
    with pytest.raises(ValueError, match="num_state_snapshots"):
        StateSnapshots(0)
