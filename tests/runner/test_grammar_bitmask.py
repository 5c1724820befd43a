"""The packed grammar bitmask on a step's logits: constrained rows keep exactly their
allowed tokens, other rows are untouched, rows of requests not in the step are skipped."""

from __future__ import annotations

import numpy as np
import torch

from raylm.runner.grammar_bitmask import apply_grammar_bitmask, unpack_bitmask
from raylm.scheduler.structured_output import GrammarOutput


def _pack(allowed: np.ndarray) -> np.ndarray:
    words = -(-allowed.shape[1] // 32)
    bits = np.zeros((allowed.shape[0], words * 32), dtype=np.int64)
    bits[:, :allowed.shape[1]] = allowed
    return (bits.reshape(len(bits), words, 32) << np.arange(32)).sum(-1).astype(
        np.uint32).view(np.int32)


def test_apply_grammar_bitmask_rows_and_bits():
    vocab = 70  # three words, the last one partly used
    rng = np.random.default_rng(0)
    allowed = rng.random((2, vocab)) < 0.3
    allowed[:, 31] = allowed[:, 63] = True  # the sign bit of a word
    logits = torch.randn(3, vocab)
    before = logits.clone()
    out = GrammarOutput(["c", "gone", "a"], _pack(np.stack([allowed[0], allowed[0],
                                                            allowed[1]])))
    apply_grammar_bitmask(logits, ["a", "free", "c"], out)
    assert torch.equal(logits[1], before[1])  # the unconstrained row
    for row, mask in ((2, allowed[0]), (0, allowed[1])):
        keep = torch.from_numpy(mask)
        assert torch.equal(logits[row][keep], before[row][keep])
        assert torch.isneginf(logits[row][~keep]).all()
    # A tokenizer shorter than the model's vocabulary: tokens past the mask are disallowed.
    short = unpack_bitmask(torch.from_numpy(_pack(np.ones((1, 32), dtype=bool))), 40)
    assert short[0, :32].all() and not short[0, 32:].any()
