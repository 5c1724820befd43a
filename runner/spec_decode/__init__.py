"""Speculative decoding on a rank: draft proposers and the step's draft/verify glue."""

from raylm.runner.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer"]
