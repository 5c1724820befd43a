"""Verification of point-mass drafts (ngram lookups and greedy draft models).

Every verified position is sampled by the ordinary Sampler as if the drafts before it were
accepted; draft j is accepted iff it equals that token and every earlier draft was
accepted. For a point-mass draft this is exact rejection sampling (the output follows the
target's distribution), and with the stateless RNG a seeded request gets the tokens it
gets without speculation.
"""

from __future__ import annotations

import numpy as np


def num_accepted_drafts(sampled: np.ndarray, draft_ids: np.ndarray,
                        num_drafts: np.ndarray) -> np.ndarray:
    """Accepted drafts per request.

    ``sampled`` [sum(num_drafts + 1)]: the target's token at each verified position,
    request by request (its drafts' positions, then the bonus position).
    ``draft_ids`` [sum(num_drafts)]: the drafts, request by request.
    """
    num_reqs = len(num_drafts)
    accepted = num_drafts.astype(np.int64)
    if draft_ids.size == 0:
        return accepted
    sample_starts = np.concatenate(([0], np.cumsum(num_drafts + 1)[:-1]))
    draft_starts = np.concatenate(([0], np.cumsum(num_drafts)[:-1]))
    # Target token at each draft's position, aligned with draft_ids.
    req_of_draft = np.repeat(np.arange(num_reqs), num_drafts)
    offset = np.arange(draft_ids.size) - draft_starts[req_of_draft]
    match = sampled[sample_starts[req_of_draft] + offset] == draft_ids
    # Leading run of matches per request: the offset of the first mismatch, if any.
    np.minimum.at(accepted, req_of_draft[~match], offset[~match])
    return accepted
