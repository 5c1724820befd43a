"""The KV cache's bookkeeping: block pool, prefix hashes, per-request block tables."""
