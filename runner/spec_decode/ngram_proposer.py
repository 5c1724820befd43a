"""Prompt-lookup (n-gram) drafts: if the request's last n tokens occurred earlier in its
prompt + output, propose the tokens that followed that occurrence.

The longest n in [prompt_lookup_min, prompt_lookup_max] that matches wins, and among its
matches the most recent one that is followed by a full run of drafts (the nearest context
is the likeliest to be repeated). Host
numpy over one row of the token history; no model, no device work.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max, (prompt_lookup_min, prompt_lookup_max)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, tokens: np.ndarray, max_drafts: int) -> np.ndarray:
        """Up to ``max_drafts`` draft ids continuing ``tokens`` (may be empty)."""
        length = len(tokens)
        if max_drafts <= 0 or length < 2:
            return tokens[:0]
        # Every n-gram match ends at an earlier occurrence of the last token: find those
        # once (one pass over the history), then extend each backwards while it keeps
        # matching. The whole lookup costs about one comparison of the history, which
        # matters because it runs for every drafting request at every step.
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
        if ends.size == 0:
            return tokens[:0]
        max_n = min(self.max_n, length - 1)
        match_len = np.ones(ends.size, np.int64)
        alive = np.ones(ends.size, bool)
        for d in range(1, max_n):
            before = ends - d
            ok = alive & (before >= 0)
            ok[ok] = tokens[before[ok]] == tokens[length - 1 - d]
            match_len += ok
            alive = ok
            if not alive.any():
                break
        for n in range(max_n, self.min_n - 1, -1):
            hits = ends[match_len >= n]  # in increasing order
            if hits.size:
                # The most recent match followed by a full run of drafts, else the oldest
                # match (the longest run there is).
                full = hits[hits + 1 + max_drafts <= length]
                start = int(full[-1] if full.size else hits[0]) + 1
                return tokens[start:min(start + max_drafts, length)]
        return tokens[:0]
