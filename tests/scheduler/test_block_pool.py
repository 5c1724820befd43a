"""BlockPool and KVCacheManager: ref counts, LRU eviction, prefix hits, deferred frees."""

from __future__ import annotations

import pytest
from sched_fake_executor import make_request

from raylm.scheduler.kv.block_pool import BlockPool
from raylm.scheduler.kv.kv_cache_manager import KVCacheManager
from raylm.scheduler.kv.kv_cache_utils import NONE_HASH, hash_block_tokens, update_block_hashes


def test_pool_get_free_and_integrity():
    pool = BlockPool(8, enable_caching=True)
    pool.check_integrity()
    a = pool.get_new_blocks(3)
    pool.check_integrity()
    assert [b.block_id for b in a] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.get_num_free_blocks() == 5
    assert pool.get_usage() == pytest.approx(3 / 8)
    pool.touch(a[:1])
    assert a[0].ref_cnt == 2
    pool.free_blocks(a)
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 7 and a[0].ref_cnt == 1
    pool.free_blocks(a[:1])
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 8
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks(a[:1])


def test_pool_refuses_more_than_free():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(ValueError, match="cannot get 3 blocks: only 2 free"):
        pool.get_new_blocks(3)


def test_pool_lru_eviction_of_cached_blocks():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [101, 102, 103, 104], 0, 4)
    pool.check_integrity()
    # Free in order 2, 0, 3, 1: the queue becomes [2, 0, 3, 1] (head first).
    for i in (2, 0, 3, 1):
        pool.free_blocks([blocks[i]])
    pool.check_integrity()
    assert pool.get_cached_block(101) is blocks[0]  # freed but still cached
    # A prefix hit on block 0 pulls it out of the queue.
    pool.touch([blocks[0]])
    pool.check_integrity()
    new = pool.get_new_blocks(2)  # evicts the least recently freed: 2 then 3
    pool.check_integrity()
    assert [b.block_id for b in new] == [2, 3]
    assert pool.get_cached_block(103) is None and pool.get_cached_block(104) is None
    assert pool.get_cached_block(102) is blocks[1] and pool.get_cached_block(101) is blocks[0]


def test_pool_makes_blocks_on_first_use_in_the_eager_queue_order():
    """Never-used ids are the queue's head in id order, before any freed block: the order
    a queue holding every block from the start would hand them out in."""
    pool = BlockPool(1 << 20, enable_caching=True)
    assert pool.blocks == [] and pool.get_num_free_blocks() == 1 << 20
    a = pool.get_new_blocks(3)
    pool.free_blocks([a[1]])
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]
    assert len(pool.blocks) == 5 and pool.is_free(1) and pool.is_free(5)
    assert not pool.is_free(0) and not pool.is_free(4)
    small = BlockPool(4, enable_caching=False)
    b = small.get_new_blocks(3)
    small.free_blocks([b[2], b[0]])
    assert [x.block_id for x in small.get_new_blocks(3)] == [3, 2, 0]
    small.check_integrity()
    assert small.get_num_free_blocks() == 0


def test_pool_duplicate_hash_keeps_first_block():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [7], 0, 1)
    pool.cache_full_blocks([b], [7], 0, 1)
    pool.check_integrity()
    assert pool.get_cached_block(7) is a and b.block_hash is None


def test_block_hashes_chain_and_cover_full_blocks_only():
    r = make_request("h", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=4)
    update_block_hashes(r, 4)
    h0 = hash_block_tokens(NONE_HASH, (1, 2, 3, 4))
    assert r.block_hashes == [h0, hash_block_tokens(h0, (5, 6, 7, 8))]
    r.append_output_token_ids([10, 11, 12])
    update_block_hashes(r, 4)
    assert len(r.block_hashes) == 3
    other = make_request("o", [0, 2, 3, 4, 5, 6, 7, 8], max_tokens=4)
    update_block_hashes(other, 4)
    assert other.block_hashes[1] != r.block_hashes[1]  # same block, different parent


def _manager(num_blocks: int = 10, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(block_size=4, num_blocks=num_blocks, enable_caching=caching)


def _admit(kv: KVCacheManager, req, num_new: int | None = None):
    update_block_hashes(req, kv.block_size)
    hits, num_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    blocks = kv.allocate_slots(req, n, hits)
    if blocks is not None:
        req.num_computed_tokens = num_hit + n
    return blocks, num_hit


def test_prefix_hit_after_cache_and_free():
    kv = _manager()
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks
    a = make_request("a", prompt)
    blocks, hit = _admit(kv, a)
    assert hit == 0 and len(blocks) == 3
    kv.cache_blocks(a, a.num_computed_tokens)
    kv.check_integrity()
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == 10
    b = make_request("b", prompt + [7, 7])
    blocks_b, hit_b = _admit(kv, b)
    kv.check_integrity()
    assert hit_b == 8
    assert [x.block_id for x in blocks_b[:2]] == a_ids[:2]
    assert blocks_b[2].block_id != a_ids[2]  # a's partial block was never cached
    assert kv.block_pool.get_num_free_blocks() == 7


def test_prefix_hit_never_covers_whole_prompt():
    kv = _manager()
    prompt = list(range(200, 208))  # exactly two full blocks
    a = make_request("a", prompt)
    _admit(kv, a)
    kv.cache_blocks(a, 8)
    b = make_request("b", prompt)
    _, hit = _admit(kv, b)
    assert hit == 4  # the last prompt token must be computed to sample from it
    kv.check_integrity()


def test_allocate_returns_none_when_short_and_counts_evictable_hits():
    kv = _manager(num_blocks=4)
    a = make_request("a", list(range(8)))
    _admit(kv, a)
    kv.cache_blocks(a, 8)
    kv.free(a)
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 17 tokens
    update_block_hashes(b, 4)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 2 evictable hits + 3 new blocks > 4 free.
    assert kv.get_num_blocks_to_allocate(b, 9, hits) == 5
    assert kv.allocate_slots(b, 9, hits) is None
    kv.check_integrity()
    assert kv.allocate_slots(b, 4, hits) is not None  # 2 hits + 1 new
    kv.check_integrity()


def test_deferred_free_waits_for_fence():
    kv = _manager()
    a = make_request("a", 6)
    kv.begin_step(1)
    _admit(kv, a)
    ids = kv.get_block_ids("a")
    kv.on_step_processed(0)
    kv.free(a)  # step 1 is still in flight
    kv.check_integrity()
    assert kv.has_deferred_frees() and kv.num_deferred_blocks == 2
    assert kv.block_pool.get_num_free_blocks() == 8
    assert not any(kv.block_pool.is_free(i) for i in ids)
    kv.on_step_processed(1)
    kv.check_integrity()
    assert not kv.has_deferred_frees()
    assert all(kv.block_pool.is_free(i) for i in ids)


def test_free_is_immediate_when_fence_passed():
    kv = _manager()
    a = make_request("a", 6)
    kv.begin_step(3)
    _admit(kv, a)
    kv.on_step_processed(3)
    kv.free(a)
    assert not kv.has_deferred_frees() and kv.block_pool.get_num_free_blocks() == 10
    kv.check_integrity()


def test_manager_integrity_detects_leak():
    kv = _manager()
    a = make_request("a", 6)
    _admit(kv, a)
    kv.req_to_blocks["a"].pop()  # lose track of a block
    with pytest.raises(AssertionError, match="holders"):
        kv.check_integrity()


def test_sliding_window_frees_blocks_behind_the_settled_window_behind_the_fence():
    """Window 6, blocks of 4: a token at p reads keys p-5..p, so once 14 tokens are settled
    the next token (p >= 14) needs keys from 9 on: blocks 0 and 1 (keys 0-7) go back. Tokens
    in flight do not count (a rejected draft could roll them back), and a block a step in
    flight may read returns to the pool only when that step has returned."""
    kv = KVCacheManager(block_size=4, num_blocks=12, enable_caching=True, group_windows=(6,))
    req = make_request("w", list(range(100, 114)), max_tokens=20)  # 14 prompt tokens
    kv.begin_step(1)
    blocks, _ = _admit(kv, req)  # 4 blocks, nothing freed at admission
    ids = [b.block_id for b in blocks]
    assert len(ids) == 4 and kv.block_pool.get_num_free_blocks() == 8
    # Step 1 is in flight with all 14 tokens: nothing is settled, nothing freed.
    req.num_in_flight_tokens = 14
    kv.begin_step(2)
    assert kv.allocate_slots(req, 1) == []
    assert kv.get_block_ids("w") == ids and kv.num_window_freed_blocks == 0
    req.num_computed_tokens += 1  # step 2 books the decode at p=14, in flight too
    # Step 1 returns: 14 settled (step 2's token still in flight); its full blocks cache.
    kv.on_step_processed(1)
    req.num_in_flight_tokens = 1
    kv.cache_blocks(req, 14)
    kv.begin_step(3)
    assert kv.allocate_slots(req, 1) is not None
    null = kv.null_block.block_id
    assert kv.get_block_ids("w")[:2] == [null, null] and kv.get_block_ids("w")[2:4] == ids[2:]
    assert kv.num_window_freed_blocks == 2
    # Step 2 (fenced on them) is still in flight: blocks 0 and 1 are not free yet.
    assert kv.block_pool.get_num_free_blocks() == 8 and kv.num_deferred_blocks == 2
    kv.check_integrity()
    kv.on_step_processed(2)
    assert kv.block_pool.get_num_free_blocks() == 10 and kv.num_deferred_blocks == 0
    # Freed but still cached: a request with the same start hits them.
    assert kv.block_pool.get_cached_block(req.block_hashes[0]).block_id == ids[0]
    kv.check_integrity()
    kv.free(req)  # frees only what it holds: no double free of the window's blocks
    kv.on_step_processed(3)
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == 12


def test_without_a_window_no_block_is_freed_early():
    kv = _manager(num_blocks=12)
    req = make_request("f", list(range(100, 130)), max_tokens=4)
    _admit(kv, req)
    kv.cache_blocks(req, req.num_computed_tokens)
    assert kv.allocate_slots(req, 1) is not None
    assert all(b is not kv.null_block for b in kv.req_to_blocks["f"])
    assert kv.num_window_freed_blocks == 0 and kv.block_pool.get_num_free_blocks() == 4
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        KVCacheManager(block_size=4, num_blocks=4, enable_caching=False, group_windows=(0,))
