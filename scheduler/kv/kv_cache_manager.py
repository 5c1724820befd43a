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

Sliding window (``sliding_window``: every layer honours it, docs/architecture.md §20): a
token at position p reads keys p - window + 1 .. p, and no token still to be computed
sits before the request's settled count (tokens of returned steps: a rejected draft rolls
back only in-flight ones). Blocks wholly before settled - window + 1 are freed as the
request grows, behind its fence (a step in flight may still read them); their places in
the block table keep ``null_block``, so positions and block indices stay aligned.
"""

from __future__ import annotations

import heapq
import itertools

from raylm.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from raylm.scheduler.kv.kv_cache_utils import cdiv
from raylm.scheduler.request import Request


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Stands in for a freed out-of-window block: never in the pool, never read (the
        # window masks its positions; id 0 keeps the block table a valid index).
        self.null_block = KVCacheBlock(0)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already replaced by null_block.
        self.num_skipped_block: dict[str, int] = {}
        # Out-of-window blocks freed so far (read by the tests).
        self.num_window_freed_blocks = 0
        # How many leading blocks of each request are indexed in the prefix cache.
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

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks.

        Never the whole sequence: the last known token must be computed to sample from it.
        """
        if not self.enable_caching or request.sampling_params.pools_every_prompt_row:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.sampling_params.prompt_logprobs is not None:
            # A cached position is never computed, so its prompt logprob would be missing.
            max_blocks = min(max_blocks, request.num_prompt_logprobs_done // self.block_size)
        blocks: list[KVCacheBlock] = []
        get = self.block_pool.get_cached_block
        for h in request.block_hashes[:max_blocks]:
            block = get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, new_computed: list[KVCacheBlock],
        num_lookahead_tokens: int,
    ) -> int:
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens,
                            self.block_size)
        return max(num_required - num_held - len(new_computed), 0)

    def get_num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None, num_lookahead_tokens: int = 0,
    ) -> int:
        """Free blocks the allocation would consume (new ones plus evictable prefix hits)."""
        new_computed = new_computed_blocks or []
        num_evictable = sum(1 for b in new_computed if b.ref_cnt == 0)
        return self._num_new_blocks(request, num_new_tokens, new_computed,
                                    num_lookahead_tokens) + num_evictable

    def allocate_slots(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None, num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens, and ``num_lookahead_tokens`` slots
        past them that a draft model writes before they are scheduled; None when the pool
        is too short.

        Returns the blocks appended to the request's block table (prefix hits first).
        """
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        if held is not None and self.sliding_window is not None:
            self._free_out_of_window(request, held)
        if held is not None and not new_computed_blocks:
            # Hot path (a running request, once per step): usually no new block at all.
            num_new = cdiv(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                           self.block_size) - len(held)
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
        num_evictable = sum(1 for b in new_computed if b.ref_cnt == 0)
        if num_new + num_evictable > self.block_pool.get_num_free_blocks():
            return None
        # Touch the hits first: get_new_blocks could otherwise evict them.
        self.block_pool.touch(new_computed)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        if held is None:
            held = self.req_to_blocks[rid] = []
            self.num_cached_block[rid] = len(new_computed)  # hits are indexed already
        held.extend(new_computed)
        held.extend(new_blocks)
        self.req_to_fence[rid] = self.current_step
        return new_computed + new_blocks if new_computed else new_blocks

    def _free_out_of_window(self, request: Request, held: list[KVCacheBlock]) -> None:
        assert self.sliding_window is not None
        rid = request.request_id
        settled = request.num_computed_tokens - request.num_in_flight_tokens
        first_needed = settled - self.sliding_window + 1
        num_skip = min(max(first_needed, 0) // self.block_size, len(held))
        done = self.num_skipped_block.get(rid, 0)
        if num_skip <= done:
            return
        freed = held[done:num_skip]
        held[done:num_skip] = [self.null_block] * (num_skip - done)
        self.num_skipped_block[rid] = num_skip
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
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if num_full > num_cached:
            # The null_block entries (freed behind the window) are never indexed.
            start = max(num_cached, self.num_skipped_block.get(rid, 0))
            if num_full > start:
                self.block_pool.cache_full_blocks(blocks, request.block_hashes, start,
                                                  num_full)
            self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, deferred until their fence step has returned."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        skipped = self.num_skipped_block.pop(rid, 0)
        fence = self.req_to_fence.pop(rid, 0)
        if not blocks:
            return
        # Tail first: a request's last blocks are the first evicted.
        self._release(blocks[:skipped - 1 if skipped else None:-1], fence)

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
        for block in blocks[block_index:]:
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
        for rid, blocks in self.req_to_blocks.items():
            skipped = self.num_skipped_block.get(rid, 0)
            assert all(b is self.null_block for b in blocks[:skipped]), rid
            for b in blocks[skipped:]:
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
