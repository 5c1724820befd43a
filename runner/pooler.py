"""Embeddings on the last pipeline stage (scheduler/pooling_params.py): the final-norm
hidden states of a request's prompt positions pooled into one vector.

A chunked prefill pools chunk by chunk: ``mean`` keeps a running fp32 sum per request
until the chunk that completes the prompt. The sums outlive a preemption (the request is
recomputed from position 0, and positions pooled already are skipped) and go when the
request finishes. Every TP rank of the stage computes the same; the host copy is a sync
point only for steps that complete an embedding request's prompt.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from raylm.runner.input_batch import CachedRequestState


class Pooler:
    def __init__(self) -> None:
        # Mean pooling in progress: request id -> (fp32 sum of its pooled rows, the next
        # prompt position to pool).
        self._sums: dict[str, tuple[torch.Tensor | None, int]] = {}  # None: no rows yet

    def pool(self, hidden: torch.Tensor, req_ids: list[str], states: list[CachedRequestState],
             num_computed: np.ndarray, num_scheduled: np.ndarray) -> dict[str, list[float]]:
        """``hidden`` [T, H], request i's rows from ``sum(num_scheduled[:i])``: the vectors
        of the embedding requests whose prompt this step completes."""
        starts = np.concatenate(([0], np.cumsum(num_scheduled)[:-1]))
        done: dict[str, torch.Tensor] = {}
        for i, state in enumerate(states):
            pooling = state.sampling_params.pooling
            if pooling is None:
                continue
            first, num_prompt = int(num_computed[i]), state.num_prompt_tokens
            end = min(first + int(num_scheduled[i]), num_prompt)
            if end <= first:
                continue  # no prompt position in this step
            rows = hidden[int(starts[i]):int(starts[i]) + end - first]
            req_id = req_ids[i]
            if pooling.pooling_type == "mean":
                vector = self._add_mean(req_id, rows, first, end, num_prompt)
            else:
                vector = rows[-1].float() if end == num_prompt else None
            if vector is not None:
                done[req_id] = (torch.nn.functional.normalize(vector, dim=0)
                                if pooling.normalize else vector)
        if not done:
            return {}
        host = torch.stack(list(done.values())).cpu()
        return {req_id: host[j].tolist() for j, req_id in enumerate(done)}

    def _add_mean(self, req_id: str, rows: torch.Tensor, first: int, end: int,
                  num_prompt: int) -> torch.Tensor | None:
        total, upto = self._sums.get(req_id, (None, 0))
        if first > upto:
            raise RuntimeError(f"{req_id}: mean pooling reached position {first} with only "
                               f"{upto} pooled (a prompt position was skipped)")
        skip = upto - first  # recomputed after a preemption: pooled already
        if skip < end - first:
            part = rows[skip:].float().sum(dim=0)
            total = part if total is None else total + part
            upto = end
        if end < num_prompt:
            self._sums[req_id] = (total, upto)
            return None
        self._sums.pop(req_id, None)
        assert total is not None
        return total / num_prompt

    def drop(self, req_ids: Iterable[str]) -> None:
        """Finished (or aborted) requests: their sums go."""
        for req_id in req_ids:
            self._sums.pop(req_id, None)
