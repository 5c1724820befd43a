"""Block hashing for prefix caching.

A block's hash chains its parent's hash with its own token ids, so equal hashes mean an
equal whole prefix (up to 64-bit hash collisions). Only full blocks of known tokens are
hashed; Python's hash of an int tuple is deterministic within a process, which is all a
per-process cache needs. A request with a LoRA adapter starts its chain from a root of its
adapter's own, so its blocks are never shared with the base model or another adapter
(the same tokens give other KV under other weights).
"""

from __future__ import annotations

from raylm.scheduler.request import Request

# Parent hash of a request's first block (any fixed int).
NONE_HASH = 0x5EED_B10C


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block_tokens(parent_block_hash: int, block_token_ids: tuple[int, ...]) -> int:
    return hash((parent_block_hash, block_token_ids))


def root_hash(request: Request) -> int:
    """The parent hash of the request's first block: NONE_HASH for the base model, one per
    adapter (its id and name) otherwise."""
    lora = request.lora_request
    if lora is None:
        return NONE_HASH
    return hash((NONE_HASH, lora.lora_int_id, lora.lora_name))


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append hashes for the request's newly full blocks of known tokens."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    start = len(hashes)
    if num_full <= start:
        return
    parent = hashes[-1] if hashes else root_hash(request)
    for i in range(start, num_full):
        parent = hash_block_tokens(parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
