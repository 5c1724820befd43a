"""KV cache groups: the layers' grouping (scheduler/config/kv_cache_groups.py) and the
KVCacheManager with several groups: interleaved block tables, a windowed group's blocks
freed behind its window while a full group's stay, prefix hits that need the full
groups' whole prefix but a windowed group's window only, and nothing leaked."""

from __future__ import annotations

from sched_fake_executor import make_request

from raylm.scheduler.config.attention_layout import layer_windows
from raylm.scheduler.config.kv_cache_groups import KVCacheGroups
from raylm.scheduler.kv.kv_cache_manager import KVCacheManager, group_block_key
from raylm.scheduler.kv.kv_cache_utils import update_block_hashes


def test_gemma3_layers_make_six_groups_of_three_sharing_three_tensors():
    windows = layer_windows("Gemma3ForCausalLM", {"num_hidden_layers": 18,
                                                  "sliding_window": 512})
    groups = KVCacheGroups.of(windows)
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.num_tensors == 3
    # The global layers 5, 11, 17 are group 0; the 15 sliding ones fill groups 1-5.
    assert [groups.layer_slots[i] for i in (5, 11, 17)] == [(0, 0), (0, 1), (0, 2)]
    assert groups.layer_slots[0] == (1, 0) and groups.layer_slots[16] == (5, 2)
    assert len(set(groups.layer_slots)) == 18  # no two layers share a page


def test_a_kind_not_a_multiple_of_the_group_size_leaves_its_last_group_short():
    windows = [None if i % 6 == 5 else 8 for i in range(26)]  # 4 global, 22 sliding
    groups = KVCacheGroups.of(windows)
    assert groups.num_tensors == 4 and groups.windows == (None,) + (8,) * 6
    assert [s for s in groups.layer_slots if s[0] == 6] == [(6, 0), (6, 1)]


def test_one_window_kind_keeps_one_group():
    assert KVCacheGroups.of([7, 7, 7]) == KVCacheGroups.single(3, 7)
    assert KVCacheGroups.of([None, None]).windows == (None,)
    assert KVCacheGroups.of([]).windows == (None,)


def _admit(kv: KVCacheManager, req):
    update_block_hashes(req, kv.block_size)
    hits, num_hit = kv.get_computed_blocks(req)
    blocks = kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert blocks is not None
    req.num_computed_tokens = req.num_tokens
    return hits, num_hit


def _groups_of(kv: KVCacheManager, rid: str) -> list[list[int]]:
    ids = kv.get_block_ids(rid)
    return [ids[g::kv.num_groups] for g in range(kv.num_groups)]


def test_a_windowed_group_frees_behind_its_window_and_a_full_group_keeps_its_blocks():
    """Blocks of 4, window 6: with 14 tokens settled the next token reads keys 9.. on, so
    the windowed group gives back its blocks 0 and 1; the full group keeps all four."""
    kv = KVCacheManager(block_size=4, num_blocks=20, enable_caching=True,
                        group_windows=(None, 6))
    req = make_request("w", list(range(100, 114)), max_tokens=8)
    _admit(kv, req)
    full, windowed = _groups_of(kv, "w")
    assert len(full) == len(windowed) == 4 and not set(full) & set(windowed)
    kv.cache_blocks(req, 14)
    assert kv.allocate_slots(req, 1) is not None
    null = kv.null_block.block_id
    now_full, now_windowed = _groups_of(kv, "w")
    assert now_full == full and now_windowed == [null, null] + windowed[2:]
    assert kv.num_window_freed_blocks == 2 and kv.block_pool.get_num_free_blocks() == 14
    kv.check_integrity()
    kv.free(req)
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == 20


def test_a_prefix_hit_takes_the_full_groups_prefix_and_the_windowed_groups_window():
    """A 14-token prompt cached; a second request with its first 13 tokens and more hits
    three blocks: the full group's three, the windowed group's last two (a token at 12
    reads keys 7.. on: blocks 1 and 2), its block 0 null."""
    kv = KVCacheManager(block_size=4, num_blocks=30, enable_caching=True,
                        group_windows=(None, 6))
    first = make_request("a", list(range(100, 114)), max_tokens=4)
    _admit(kv, first)
    kv.cache_blocks(first, 14)
    a_full, a_windowed = _groups_of(kv, "a")
    second = make_request("b", list(range(100, 113)) + [7, 8, 9, 10, 11], max_tokens=4)
    hits, num_hit = _admit(kv, second)
    assert num_hit == 12 and len(hits) == 6
    b_full, b_windowed = _groups_of(kv, "b")
    assert b_full[:3] == a_full[:3]
    assert b_windowed[0] == kv.null_block.block_id and b_windowed[1:3] == a_windowed[1:3]
    assert kv.num_skipped_block["b"] == [0, 1]
    kv.check_integrity()
    # Its own new full blocks index under the windowed group's key too, never the null one.
    kv.cache_blocks(second, second.num_tokens)
    assert kv.block_pool.get_cached_block(
        group_block_key(second.block_hashes[3], 1)).block_id == b_windowed[3]
    kv.free(first)
    kv.free(second)
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == 30


def test_a_windowed_block_missing_inside_the_window_shortens_the_hit():
    """The windowed group's block 2 is dropped from the cache: a hit of 3 blocks would
    read it, so the hit falls back to 2 blocks (a token at 8 reads keys 3.., blocks 0 and
    1, both cached)."""
    kv = KVCacheManager(block_size=4, num_blocks=30, enable_caching=True,
                        group_windows=(None, 6))
    first = make_request("a", list(range(100, 114)), max_tokens=4)
    _admit(kv, first)
    kv.cache_blocks(first, 14)
    kv.block_pool.uncache(kv.req_to_blocks["a"][2 * 2 + 1])
    second = make_request("b", list(range(100, 113)) + [7, 8], max_tokens=4)
    _, num_hit = _admit(kv, second)
    assert num_hit == 8
    assert kv.num_skipped_block["b"] == [0, 0]
    kv.check_integrity()
    kv.free(first)
    kv.free(second)
    assert kv.block_pool.get_num_free_blocks() == 30
