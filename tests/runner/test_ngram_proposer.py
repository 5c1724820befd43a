"""Prompt lookup against a brute-force statement of its rule, on small vocabularies (many
matches, overlapping ones included)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raylm.runner.spec_decode.ngram_proposer import NgramProposer


def _reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The longest n in [lo, hi] whose last n tokens occur earlier; among its matches the
    latest followed by k tokens, else the earliest; the tokens that follow it."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = tokens[length - n:]
        starts = [s for s in range(length - n) if tokens[s:s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + k <= length]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start:start + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3), st.integers(0, 5), st.integers(2, 6),
       st.data())
def test_matches_the_rule(lo, extra, k, vocab, data):
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    got = NgramProposer(lo, lo + extra).propose(np.array(tokens, np.int64), k)
    assert got.tolist() == _reference(tokens, lo, lo + extra, k)


def test_examples():
    p = NgramProposer(1, 3)
    t = np.array([5, 6, 7, 8, 1, 5, 6, 7], np.int64)
    assert p.propose(t, 3).tolist() == [8, 1, 5]  # "5 6 7" matched: what followed it
    assert p.propose(t, 0).tolist() == []
    assert p.propose(np.array([1, 2, 3, 4], np.int64), 3).tolist() == []  # no match
