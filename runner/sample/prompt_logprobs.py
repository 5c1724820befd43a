"""Prompt logprobs on the last pipeline stage (``SamplingParams.prompt_logprobs``): the
logprob, rank and top-k of each prompt token under the position before it.

A chunked prefill yields them chunk by chunk (the scheduler never lets a prefix-cache hit
cover a position still owed). Values come from the raw logits (before temperature or
penalties), as vLLM's default; the host copy is a sync point only for steps holding such a
request.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from raylm.runner.input_batch import CachedRequestState
from raylm.scheduler.core_outputs import LogprobsLists, PromptLogprobsChunk

# Rows of [rows, vocab] float32 logits computed at once: bounds the memory a long prompt
# takes (a 2048-token chunk of a 49k vocabulary would be 400 MB in one piece).
_ROWS_PER_SLICE = 256


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
    req_ids: list[str], states: list[CachedRequestState], num_computed: np.ndarray,
    num_scheduled: np.ndarray,
) -> dict[str, PromptLogprobsChunk]:
    """``hidden`` [T, H] is the step's hidden states, request i's tokens at
    ``sum(num_scheduled[:i])`` onwards. Every TP rank of the stage calls this with the same
    arguments (``compute_logits`` gathers the vocabulary across them)."""
    starts = np.concatenate(([0], np.cumsum(num_scheduled)[:-1]))
    flat: list[np.ndarray] = []
    targets: list[list[int]] = []
    spans: list[tuple[str, int, int, int]] = []  # (req_id, start position, rows, top-k)
    for i, state in enumerate(states):
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        first = int(num_computed[i])
        end = min(first + int(num_scheduled[i]), state.num_prompt_tokens - 1)
        if end <= first:
            continue  # only output positions (or the last prompt token) in this step
        flat.append(starts[i] + np.arange(end - first))
        targets.append(state.prompt_token_ids[first + 1:end + 1])
        spans.append((req_ids[i], first, end - first, k))
    if not spans:
        return {}
    index = torch.from_numpy(np.concatenate(flat)).to(hidden.device)
    target = torch.tensor([t for ts in targets for t in ts], device=hidden.device)
    max_k = max(k for *_, k in spans)
    values, ids, ranks, topv, topi = [], [], [], [], []
    for lo in range(0, len(index), _ROWS_PER_SLICE):
        sl = slice(lo, lo + _ROWS_PER_SLICE)
        logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, index[sl])).float(),
                                     dim=-1)
        chosen = logprobs.gather(1, target[sl, None])
        values.append(chosen[:, 0])
        ids.append(target[sl])
        ranks.append((logprobs > chosen).sum(dim=1) + 1)
        if max_k:
            top = logprobs.topk(max_k, dim=-1)
            topv.append(top.values)
            topi.append(top.indices)
    value_h = torch.cat(values).cpu().numpy()
    rank_h = torch.cat(ranks).cpu().numpy()
    # Without top-k nothing reads them (empty stand-ins).
    topv_h = torch.cat(topv).cpu().numpy() if max_k else np.empty((0, 0), np.float32)
    topi_h = torch.cat(topi).cpu().numpy() if max_k else np.empty((0, 0), np.int64)
    out: dict[str, PromptLogprobsChunk] = {}
    row = 0
    for (req_id, first, n, k), ts in zip(spans, targets, strict=True):
        token_ids: list[list[int]] = []
        row_logprobs: list[list[float]] = []
        for j in range(row, row + n):
            token_ids.append([ts[j - row]] + (topi_h[j, :k].tolist() if k else []))
            row_logprobs.append([float(value_h[j])] + (topv_h[j, :k].tolist() if k else []))
        out[req_id] = PromptLogprobsChunk(first, LogprobsLists(
            token_ids, row_logprobs, rank_h[row:row + n].tolist()))
        row += n
    return out
