"""Speculative decoding on the scheduler side: how many drafts a step can use, and the
acceptance counters exported with vLLM's names (``raylm:spec_decode_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylm.scheduler.request import Request


def num_useful_drafts(request: Request) -> int:
    """The most drafts a decode of ``request`` scheduled now can still turn into output.

    The step emits at most ``1 + drafts`` tokens after every token the request is sure to
    have by then: its confirmed outputs plus one from a sampling step still in flight
    (vLLM's ``_drafts_unused`` bound). Drafts past ``max_tokens`` could never be kept.
    """
    min_outputs_before = request.num_output_tokens + (
        1 if request.num_output_placeholders > 0 else 0)
    return max(request.max_tokens - min_outputs_before - 1, 0)


@dataclass
class SpecDecodingCounters:
    """Cumulative counters; ``num_accepted_tokens_per_pos[i]``: drafts accepted at
    draft position i (a draft is accepted only after every earlier one is)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        assert 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens, (
            f"accepted {num_accepted_tokens} of {num_draft_tokens} drafts "
            f"(k={self.num_spec_tokens})")
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "raylm:spec_decode_num_drafts": self.num_drafts,
            "raylm:spec_decode_num_draft_tokens": self.num_draft_tokens,
            "raylm:spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for pos, n in enumerate(self.num_accepted_tokens_per_pos):
            out[f'raylm:spec_decode_num_accepted_tokens_per_pos{{position="{pos}"}}'] = n
        return out
