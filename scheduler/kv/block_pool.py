"""The KV block pool: reference counts, an LRU free queue and the prefix-cache index.

Invariants (``check_integrity`` asserts them; the tests call it after every operation and
the EngineCore whenever it goes idle):

1. Every block is in exactly one of three states: never handed out (free, at the head of
   the queue, no object made for it yet), in the free queue with ``ref_cnt == 0``, or out
   of it with ``ref_cnt > 0`` (held by requests or by a deferred free).
2. ``num_free + num_used == num_blocks``.
3. ``cached_block_hash_to_block[h] is b`` implies ``b.block_hash == h``, and every block
   with a ``block_hash`` is indexed under it (only full blocks whose KV is settled are).
   A cached block may sit in the free queue: it is reusable by a prefix hit until it
   reaches the head of the queue and is evicted (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from raylm.scheduler.config.validation import check_at_least


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        check_at_least("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Blocks are made when first handed out (a pool of a million blocks would cost
        # seconds at start-up and at every idle integrity check): ids from len(blocks) on
        # were never used and are the free queue's head, in id order, before any freed one.
        self.blocks: list[KVCacheBlock] = []
        # Blocks freed after use. Head = next to be handed out (and evicted if cached);
        # tail = most recently freed.
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        # Called with (block_hash, block_id) when a cached block is evicted for reuse (a KV
        # offload tier keeps its content; its KV is settled and no step in flight uses it).
        self.on_evict: Callable[[int, int], None] | None = None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free.")
        start = len(self.blocks)
        out = [KVCacheBlock(i) for i in range(start, min(start + num_blocks, self.num_blocks))]
        self.blocks.extend(out)
        for block in out:
            block.ref_cnt = 1
        for _ in range(num_blocks - len(out)):
            _, block = self.free_block_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is not None:
            if self.cached_block_hash_to_block.get(h) is block:
                del self.cached_block_hash_to_block[h]
                if self.on_evict is not None:
                    self.on_evict(h, block.block_id)
            block.block_hash = None

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop a block from the prefix-cache index (its KV is not what its hash says: a
        failed load); the block itself stays where it is."""
        h = block.block_hash
        if h is not None:
            if self.cached_block_hash_to_block.get(h) is block:
                del self.cached_block_hash_to_block[h]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (prefix-hit) blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; unreferenced blocks go to the queue tail, still cached.

        Callers pass a request's blocks tail first, so its last blocks are evicted first.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id} (ref_cnt {block.ref_cnt})"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[int],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        A hash already indexed (the same content computed twice) keeps its first block; the
        duplicate stays unindexed and is freed as an ordinary block.
        """
        if not self.enable_caching:
            return
        index = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block, h = blocks[i], block_hashes[i]
            if block.block_hash is not None or h in index:
                continue
            block.block_hash = h
            index[h] = block

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue) + self.num_blocks - len(self.blocks)

    def is_free(self, block_id: int) -> bool:
        return block_id >= len(self.blocks) or block_id in self.free_block_queue

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def check_integrity(self) -> None:
        assert all(b.block_id == i for i, b in enumerate(self.blocks)), "blocks out of id order"
        num_free = self.get_num_free_blocks()
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert num_free + num_used == self.num_blocks, (
            f"free {num_free} + used {num_used} != total {self.num_blocks}")
        for block_id, block in self.free_block_queue.items():
            assert self.blocks[block_id] is block and block.ref_cnt == 0, (
                f"block {block.block_id} in the free queue under id {block_id} "
                f"with ref_cnt {block.ref_cnt}")
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"block {block.block_id} has hash {block.block_hash} but is not indexed")
        for h, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == h, (
                f"index maps hash {h} to block {block.block_id} whose hash is {block.block_hash}")
