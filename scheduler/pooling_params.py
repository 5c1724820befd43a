"""Embeddings (``SamplingParams.pooling``): the prompt's last hidden states pooled into
one vector, computed by the same scheduler and steps as generation.

An embedding request is a one-token generation whose sampled token the API discards: it
then needs nothing of its own in the scheduler, the async ledger or the KV cache. The last
pipeline stage pools the final-norm hidden states of the prompt positions
(``runner/pooler.py``); the vector comes back with the step that completes the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """``last``: the last prompt token's hidden state (a decoder's summary of the whole
    prompt); ``mean``: the mean over every prompt token. ``normalize``: L2-normalized,
    as vLLM's embed task returns them."""

    pooling_type: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}.")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}.")

    @property
    def needs_every_prompt_row(self) -> bool:
        """Mean pooling reads every prompt position: no prefix-cache hit may skip one."""
        return self.pooling_type == "mean"
