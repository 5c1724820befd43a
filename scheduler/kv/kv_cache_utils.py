"""Block hashing for prefix caching.

A block's hash chains its parent's hash with its own token ids, so equal hashes mean an
equal whole prefix (up to 64-bit hash collisions). Only full blocks of known tokens are
hashed; Python's hash of an int tuple is deterministic within a process, which is all a
per-process cache needs.
"""

from __future__ import annotations

from raylm.scheduler.request import Request

# Parent hash of a request's first block (any fixed int).
NONE_HASH = 0x5EED_B10C


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block_tokens(parent_block_hash: int, block_token_ids: tuple[int, ...]) -> int:
    return hash((parent_block_hash, block_token_ids))


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append hashes for the request's newly full blocks of known tokens."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    start = len(hashes)
    if num_full <= start:
        return
    parent = hashes[-1] if hashes else NONE_HASH
    for i in range(start, num_full):
        parent = hash_block_tokens(parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
