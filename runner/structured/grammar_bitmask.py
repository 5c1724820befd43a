"""Apply a grammar's packed token bitmask to a step's logits (structured outputs).

The bitmask comes from the EngineCore as a numpy int32 array, one row per constrained
request, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (xgrammar's
layout). Rows of unconstrained requests are not touched: their tokens stay exactly what
they would be alone. Disallowed tokens get -inf before any other processing, so greedy,
sampling and logprobs all see the constrained distribution (as vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from raylm.runner.pp_ring import SampledTokenTransport
from raylm.runner.prepare_inputs import StepBatch, upload
from raylm.runner.prompt_results import PromptResults
from raylm.scheduler.structured.manager import GrammarOutput


@dataclass
class DeferredSampling:
    """A step whose forward ran and whose sampling waits for its grammar bitmask."""

    step_id: int
    batch: StepBatch
    # The sampled positions' logits; with speculative decoding the hidden states instead
    # (which positions verification needs depends on the drafts the grammar keeps).
    logits: torch.Tensor
    pp_transport: SampledTokenTransport | None
    # Computed with the forward (they need its hidden states, not the bitmask).
    prompt_results: PromptResults = field(default_factory=PromptResults)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, ceil(V/32)] int32 -> [n, V] bool (True = allowed); bits past the mask's width
    (a vocabulary padded beyond the tokenizer's) are disallowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros((bits.shape[0], vocab_size - bits.shape[1]), dtype=torch.bool,
                      device=bits.device)
    return torch.cat((bits, pad), dim=1)


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str],
                          grammar_output: GrammarOutput,
                          first_rows: list[int] | None = None) -> None:
    """Mask, in place, the logits rows of the constrained requests in ``req_ids``.

    Row ``i`` of ``logits`` belongs to ``req_ids[i]``; with speculative decoding
    (``grammar_output.num_draft_tokens``) request ``req_ids[i]``'s verified positions are
    the ``1 + num_draft_tokens`` rows from ``first_rows[i]`` on, one bitmask row each."""
    index = {rid: i for i, rid in enumerate(req_ids)}
    per_request = grammar_output.num_draft_tokens
    mask_rows: list[int] = []
    logit_rows: list[int] = []
    mask_row = 0
    for j, rid in enumerate(grammar_output.structured_output_request_ids):
        n = 1 if per_request is None else 1 + per_request[j]
        i = index.get(rid)
        if i is not None:
            start = i if first_rows is None else first_rows[i]
            mask_rows.extend(range(mask_row, mask_row + n))
            logit_rows.extend(range(start, start + n))
        mask_row += n
    assert mask_row == len(grammar_output.grammar_bitmask), (
        f"{mask_row} bitmask rows expected, {len(grammar_output.grammar_bitmask)} sent")
    if not logit_rows:
        return
    # Pinned and non-blocking on CUDA: the step never waits on this upload.
    bitmask = upload(grammar_output.grammar_bitmask[mask_rows], logits.device)
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    rows = upload(np.asarray(logit_rows, dtype=np.int64), logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
