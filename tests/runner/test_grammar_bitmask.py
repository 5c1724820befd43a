"""The packed grammar bitmask on a step's logits: constrained rows keep exactly their
allowed tokens, other rows are untouched, rows of requests not in the step are skipped."""

from __future__ import annotations

import numpy as np
import torch

from raylm.runner.structured.grammar_bitmask import apply_grammar_bitmask, unpack_bitmask
from raylm.scheduler.structured.manager import GrammarOutput


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


def _bit(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def test_spec_bitmask_cuts_drafts_and_rolls_the_matcher_back(llama_path):
    """A row per verified position (the matcher advanced through the drafts it accepts,
    then rolled back); drafts cut at the first refused one; after a draft stop token
    only stop tokens may follow."""
    from transformers import AutoTokenizer

    from raylm.runner.structured.xgrammar_backend import XgrammarBackend
    from raylm.scheduler.structured.params import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    backend = XgrammarBackend(tokenizer, 512)
    regex = backend.new_grammar(backend.compile(StructuredOutputsParams(regex=r"\d{3}-\d{4}")))
    choice = backend.new_grammar(backend.compile(StructuredOutputsParams(choice=["ab"])))
    digits = tokenizer.encode("555-12", add_special_tokens=False)
    letter = tokenizer.encode("x", add_special_tokens=False)
    ab = tokenizer.encode("ab", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    before = backend.build_bitmask([regex, choice])
    rows, kept = backend.build_spec_bitmask(
        [regex, None, choice], [digits + letter + digits, [7, 8], ab + [eos] + ab])
    assert kept == [len(digits), 0, len(ab) + 1]
    assert len(rows) == sum(1 + k for k in kept)
    regex_rows, free_row, choice_rows = (rows[:len(digits) + 1], rows[len(digits) + 1],
                                         rows[len(digits) + 2:])
    assert (free_row == -1).all()
    for row, token in zip(regex_rows, digits + letter, strict=True):
        assert _bit(row, token) == (token != letter[0])
    for row, token in zip(choice_rows[:-1], ab + [eos], strict=True):
        assert _bit(row, token)
    assert not _bit(choice_rows[0], eos)  # the grammar cannot end before "ab"
    assert [t for t in range(512) if _bit(choice_rows[-1], t)] == [eos]  # after the stop
    # Rolled back: the matchers are where they were, and advance on settled tokens.
    assert np.array_equal(backend.build_bitmask([regex, choice]), before)
    assert regex.accept_tokens(digits) and not regex.is_terminated()
    assert np.array_equal(backend.build_bitmask([regex])[0], regex_rows[-1])
