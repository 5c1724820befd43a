"""Per-request KV blocks on top of the BlockPool: prefix hits, allocation, deferred frees.

Deferred free with a step fence (docs/architecture.md §3 rule 5): a request's blocks may still be
written by a step that is in flight when the request finishes, aborts or is preempted.
``free`` therefore tags them with the newest step scheduled with them (the fence) and
``on_step_processed(step_id)`` returns them to the pool once that step's result is back.
In synchronous mode the fence is already passed when a request is freed outside
``update_from_output`` (preemption), and is passed at the end of the same
``update_from_output`` otherwise, so the same code path frees at once.

Prefix caching registers a block only when its KV is settled (the step that computed it
has returned) and all its tokens are known: ``cache_blocks`` is called from
``update_from_output`` with the settled token count.

KV cache groups (``group_windows``, one window or None per group; docs/architecture.md
§20): each group of layers has its own block table, all drawn from this pool, and grows
in lockstep with the others, so a request's blocks are kept interleaved: logical block j
of group g is ``req_to_blocks[rid][j * G + g]``. One group (G = 1) is the plain table.

Sliding window: a token at position p reads keys p - window + 1 .. p, and no token still
to be computed sits before the request's settled count (tokens of returned steps: a
rejected draft rolls back only in-flight ones). A windowed group's blocks wholly before
settled - window + 1 are freed as the request grows, behind its fence (a step in flight
may still read them); their places keep ``null_block``, so positions and block indices
stay aligned. A prefix hit needs every full-attention group's blocks up to the hit and a
windowed group's only within the window before it (the others stay null): the longest
such hit is found from the full groups' prefix down (vLLM's fixed point over groups).
"""

from __future__ import annotations

import heapq
import itertools

from raylm.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from raylm.scheduler.kv.kv_cache_utils import cdiv
from raylm.scheduler.request import Request


def group_block_key(block_hash: int, group: int) -> int:
    """The prefix-cache key of a group's block: the same tokens give other KV in another
    group's layers."""
    return block_hash if group == 0 else hash((block_hash, group))


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool,
                 group_windows: tuple[int | None, ...] = (None,),
                 drop_last_hit_block: bool = False) -> None:
        if not group_windows:
            raise ValueError("group_windows must name at least one group.")
        for window in group_windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be at least 1, got {window}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # An EAGLE head's KV at a block's last position pairs it with the token after the
        # block, which another request's hit need not share: a hit gives up its last block,
        # recomputed so that the head sees the target's hidden state there.
        self.drop_last_hit_block = drop_last_hit_block
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self._windowed = [g for g, w in enumerate(self.group_windows) if w is not None]
        self._full = [g for g, w in enumerate(self.group_windows) if w is None]
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Stands in for a freed out-of-window block: never in the pool, never read (the
        # window masks its positions; id 0 keeps the block table a valid index).
        self.null_block = KVCacheBlock(0)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request, per group: leading logical blocks already replaced by null_block.
        self.num_skipped_block: dict[str, list[int]] = {}
        # Out-of-window blocks freed so far (read by the tests).
        self.num_window_freed_blocks = 0
        # How many leading logical blocks of each request are indexed in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Newest step id scheduled with each request's blocks.
        self.req_to_fence: dict[str, int] = {}
        # Min-heap of (fence, seq, blocks tail first) waiting for their fence to pass.
        self._deferred: list[tuple[int, int, list[KVCacheBlock]]] = []
        self._deferred_seq = itertools.count()
        self.num_deferred_blocks = 0
        self.current_step = 0
        self.last_processed_step = 0
        # Cumulative prefix-cache counters, in tokens (as vLLM's queries / hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def begin_step(self, step_id: int) -> None:
        """Blocks allocated from now on are fenced by ``step_id``."""
        self.current_step = step_id

    def _first_in_window(self, num_tokens: int, window: int) -> int:
        """The first logical block a token at position ``num_tokens`` still reads."""
        return max(num_tokens - window + 1, 0) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks (each group's, interleaved;
        null_block where a windowed group no longer reads).

        Never the whole sequence: the last known token must be computed to sample from it.
        """
        if not self.enable_caching or request.sampling_params.pools_every_prompt_row:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.sampling_params.prompt_logprobs is not None:
            # A cached position is never computed, so its prompt logprob would be missing.
            max_blocks = min(max_blocks, request.num_prompt_logprobs_done // self.block_size)
        get = self.block_pool.get_cached_block
        hashes = request.block_hashes[:max_blocks]
        G = self.num_groups
        if G == 1 and self._full:  # the plain table: its longest cached prefix
            blocks: list[KVCacheBlock] = []
            for h in hashes:
                block = get(h)
                if block is None:
                    break
                blocks.append(block)
            if self.drop_last_hit_block and blocks:
                blocks.pop()
            return blocks, len(blocks) * self.block_size
        # Full-attention groups, left to right.
        num_hit = len(hashes)
        for j, h in enumerate(hashes):
            if any(get(group_block_key(h, g)) is None for g in self._full):
                num_hit = j
                break
        if self.drop_last_hit_block:
            num_hit = max(num_hit - 1, 0)
        # Windowed groups: each needs its window's blocks before the hit, right to left;
        # a miss at block j leaves only hits that end at or before it.
        while num_hit > 0:
            miss = -1
            for g in self._windowed:
                window = self.group_windows[g]
                assert window is not None
                for j in range(num_hit - 1, self._first_in_window(num_hit * self.block_size,
                                                                   window) - 1, -1):
                    if get(group_block_key(hashes[j], g)) is None:
                        miss = max(miss, j)
                        break
            if miss < 0:
                break
            num_hit = miss
        first = [0 if window is None else self._first_in_window(num_hit * self.block_size,
                                                                  window)
                 for window in self.group_windows]
        out: list[KVCacheBlock] = []
        for j in range(num_hit):
            for g in range(G):
                if j < first[g]:
                    out.append(self.null_block)
                else:
                    block = get(group_block_key(hashes[j], g))
                    assert block is not None
                    out.append(block)
        return out, num_hit * self.block_size

    def record_prefix_cache_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, new_computed: list[KVCacheBlock],
        num_lookahead_tokens: int,
    ) -> int:
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        num_computed = (request.num_computed_tokens
                        + len(new_computed) // self.num_groups * self.block_size)
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens,
                            self.block_size) * self.num_groups
        return max(num_required - num_held - len(new_computed), 0)

    def _num_evictable(self, new_computed: list[KVCacheBlock]) -> int:
        null = self.null_block
        return sum(1 for b in new_computed if b.ref_cnt == 0 and b is not null)

    def get_num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None, num_lookahead_tokens: int = 0,
    ) -> int:
        """Free blocks the allocation would consume (new ones plus evictable prefix hits)."""
        new_computed = new_computed_blocks or []
        return self._num_new_blocks(request, num_new_tokens, new_computed,
                                    num_lookahead_tokens) + self._num_evictable(new_computed)

    def allocate_slots(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None, num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens, and ``num_lookahead_tokens`` slots
        past them that a draft model writes before they are scheduled; None when the pool
        is too short.

        Returns the blocks appended to the request's block table (prefix hits first;
        every group's, interleaved).
        """
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        if held is not None and self._windowed:
            self._free_out_of_window(request, held)
        if held is not None and not new_computed_blocks:
            # Hot path (a running request, once per step): usually no new block at all.
            num_new = cdiv(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                           self.block_size) * self.num_groups - len(held)
            if num_new > 0:
                if num_new > self.block_pool.get_num_free_blocks():
                    return None
                new_blocks = self.block_pool.get_new_blocks(num_new)
                held.extend(new_blocks)
            else:
                new_blocks = []
            self.req_to_fence[rid] = self.current_step
            return new_blocks
        new_computed = new_computed_blocks or []
        assert not (new_computed and held), (
            f"prefix hits for {rid} that already holds {len(held or ())} blocks")
        num_new = self._num_new_blocks(request, num_new_tokens, new_computed,
                                       num_lookahead_tokens)
        if num_new + self._num_evictable(new_computed) > self.block_pool.get_num_free_blocks():
            return None
        # Touch the hits first: get_new_blocks could otherwise evict them.
        null = self.null_block
        self.block_pool.touch(b for b in new_computed if b is not null)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        if held is None:
            held = self.req_to_blocks[rid] = []
            num_hit = len(new_computed) // self.num_groups
            self.num_cached_block[rid] = num_hit  # hits are indexed already
            self.num_skipped_block[rid] = [
                0 if window is None else self._first_in_window(num_hit * self.block_size,
                                                               window) if num_hit else 0
                for window in self.group_windows]
        held.extend(new_computed)
        held.extend(new_blocks)
        self.req_to_fence[rid] = self.current_step
        return new_computed + new_blocks if new_computed else new_blocks

    def _free_out_of_window(self, request: Request, held: list[KVCacheBlock]) -> None:
        rid = request.request_id
        settled = request.num_computed_tokens - request.num_in_flight_tokens
        G = self.num_groups
        num_logical = len(held) // G
        skipped = self.num_skipped_block[rid]
        freed: list[KVCacheBlock] = []
        for g in self._windowed:
            window = self.group_windows[g]
            assert window is not None
            num_skip = min(self._first_in_window(settled, window), num_logical)
            done = skipped[g]
            if num_skip <= done:
                continue
            for j in range(done, num_skip):
                freed.append(held[j * G + g])
                held[j * G + g] = self.null_block
            skipped[g] = num_skip
        if freed:
            self.num_window_freed_blocks += len(freed)
            # A step in flight may still read them: they go back behind the request's fence.
            self._release(freed[::-1], self.req_to_fence.get(rid, 0))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks among its first ``num_tokens`` settled tokens."""
        if not self.enable_caching or request.sampling_params.pools_every_prompt_row:
            return
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid)
        if num_cached is None or num_tokens // self.block_size <= num_cached:
            return  # no new full block (the common case)
        blocks = self.req_to_blocks[rid]
        G = self.num_groups
        hashes = request.block_hashes
        num_full = min(num_tokens // self.block_size, len(hashes), len(blocks) // G)
        if num_full > num_cached:
            skipped = self.num_skipped_block[rid]
            for g in range(G):
                # The null_block entries (freed behind the window) are never indexed.
                start = max(num_cached, skipped[g])
                if num_full <= start:
                    continue
                if G == 1:
                    self.block_pool.cache_full_blocks(blocks, hashes, start, num_full)
                else:
                    self.block_pool.cache_full_blocks(
                        blocks[start * G + g:num_full * G:G],
                        [group_block_key(h, g) for h in hashes[start:num_full]],
                        0, num_full - start)
            self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, deferred until their fence step has returned."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        self.num_skipped_block.pop(rid, None)
        fence = self.req_to_fence.pop(rid, 0)
        if not blocks:
            return
        # Tail first: a request's last blocks are the first evicted.
        null = self.null_block
        self._release([b for b in reversed(blocks) if b is not null], fence)

    def _release(self, blocks: list[KVCacheBlock], fence: int) -> None:
        """Free ``blocks`` once step ``fence`` has returned (at once if it has)."""
        if not blocks:
            return
        if fence <= self.last_processed_step:
            self.block_pool.free_blocks(blocks)
        else:
            heapq.heappush(self._deferred, (fence, next(self._deferred_seq), blocks))
            self.num_deferred_blocks += len(blocks)

    def on_step_processed(self, step_id: int) -> None:
        """Step ``step_id`` (and every earlier one) has returned: pass its fences."""
        if step_id > self.last_processed_step:
            self.last_processed_step = step_id
        deferred = self._deferred
        while deferred and deferred[0][0] <= self.last_processed_step:
            _, _, blocks = heapq.heappop(deferred)
            self.num_deferred_blocks -= len(blocks)
            self.block_pool.free_blocks(blocks)

    def invalidate_from(self, request_id: str, block_index: int) -> None:
        """A failed load: the request's blocks from ``block_index`` on hold garbage, so none
        of them may be a prefix-cache hit and only the ones before stay indexed for it."""
        blocks = self.req_to_blocks.get(request_id, ())
        for block in blocks[block_index * self.num_groups:]:
            if block is not self.null_block:
                self.block_pool.uncache(block)
        if request_id in self.num_cached_block:
            self.num_cached_block[request_id] = min(self.num_cached_block[request_id],
                                                    block_index)

    def uncache_block_ids(self, block_ids: set[int]) -> None:
        """Drop blocks a load failed for from the prefix-cache index, whoever holds them."""
        made = self.block_pool.blocks
        for block_id in block_ids:
            if block_id < len(made):  # else never handed out: nothing indexed
                self.block_pool.uncache(made[block_id])

    def has_deferred_frees(self) -> bool:
        return bool(self._deferred)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def check_integrity(self) -> None:
        """Pool invariants, plus: each ref_cnt equals the holders (requests, deferred)."""
        self.block_pool.check_integrity()
        holders = [0] * len(self.block_pool.blocks)
        G = self.num_groups
        for rid, blocks in self.req_to_blocks.items():
            assert len(blocks) % G == 0, f"{rid}: {len(blocks)} blocks for {G} groups"
            skipped = self.num_skipped_block[rid]
            for i, b in enumerate(blocks):
                if i // G < skipped[i % G]:
                    assert b is self.null_block, f"{rid}: a held block before the window"
                    continue
                assert b is not self.null_block, f"{rid}: null block past the skipped ones"
                holders[b.block_id] += 1
        num_deferred = 0
        for _, _, blocks in self._deferred:
            num_deferred += len(blocks)
            for b in blocks:
                holders[b.block_id] += 1
        assert num_deferred == self.num_deferred_blocks, (
            f"deferred count {self.num_deferred_blocks} != {num_deferred} deferred blocks")
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} "
                f"but {holders[block.block_id]} holders")
