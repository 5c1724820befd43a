"""Prompt-lookup (n-gram) drafts: if the request's last n tokens occurred earlier in its
prompt + output, propose the tokens that followed that occurrence.

The longest n in [prompt_lookup_min, prompt_lookup_max] that matches wins, and among its
matches the most recent one that is followed by a full run of drafts (the nearest context
is the likeliest to be repeated). Host
numpy over one row of the token history; no model, no device work.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max, (prompt_lookup_min, prompt_lookup_max)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, tokens: np.ndarray, max_drafts: int) -> np.ndarray:
        """Up to ``max_drafts`` draft ids continuing ``tokens`` (may be empty)."""
        length = len(tokens)
        if max_drafts <= 0:
            return tokens[:0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start early enough to be followed by at least one token.
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                # The most recent match followed by a full run of drafts, else the oldest
                # match (the longest run there is).
                full = hits[hits + n + max_drafts <= length]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start:min(start + max_drafts, length)]
        return tokens[:0]
