"""Verification of point-mass drafts: the accepted-run arithmetic, and a statistical check
that accepting a draft iff the target's seeded draw equals it is rejection sampling (the
emitted tokens follow the target distribution, drafts are accepted with probability p(x))."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.runner.sample.rejection_sampler import num_accepted_drafts
from raylm.runner.sample.sampler import Sampler, SamplingMetadata


def test_accepted_runs_stop_at_the_first_mismatch():
    # Three requests: drafts [5, 6] (both match), none, [2] (mismatch).
    sampled = np.array([5, 6, 7, 1, 9, 9])
    assert num_accepted_drafts(sampled, np.array([5, 6, 2]), np.array([2, 0, 1])).tolist() == [2, 0, 0]
    # A mismatch ends the run even if a later draft matches again.
    sampled = np.array([4, 8, 3, 0])
    assert num_accepted_drafts(sampled, np.array([4, 9, 3]), np.array([3])).tolist() == [1]
    assert num_accepted_drafts(np.array([1, 2]), np.zeros(0, np.int64), np.array([0, 0])).tolist() == [0, 0]


def _seeded_draws(probs: np.ndarray, num: int, position: int) -> np.ndarray:
    """The Sampler's tokens for ``num`` seeds from one distribution (temperature 1)."""
    logits = torch.log(torch.tensor(probs, dtype=torch.float32)).repeat(num, 1)
    md = SamplingMetadata(
        temperature=torch.ones(num), all_greedy=False, all_random=True, is_greedy=None,
        top_k=None, top_p=None, min_p=None, seeds=torch.arange(num, dtype=torch.int64) * 7919 + 1,
        positions=torch.full((num,), position, dtype=torch.int64))
    return Sampler(len(probs), torch.device("cpu"))(logits, md).sampled_token_ids[:, 0].numpy()


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_output_distribution_is_the_target(draft):
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    num = 40_000
    # Two verified positions: the draft at the first, the bonus at the second.
    sampled = np.stack([_seeded_draws(probs, num, 17), _seeded_draws(probs, num, 18)], 1)
    accepted = num_accepted_drafts(sampled.reshape(-1), np.full(num, draft),
                                   np.ones(num, np.int64))
    first = sampled[:, 0]  # the emitted token at the draft's position, accepted or not
    # One std of a frequency is at most 0.5 / sqrt(num) = 0.0025: bounds of 5 stds.
    tol = 5 * 0.5 / np.sqrt(num)
    assert abs(accepted.mean() - probs[draft]) < tol  # min(1, p(x) / q(x)) with q(x) = 1
    freq = np.bincount(first, minlength=len(probs)) / num
    assert np.abs(freq - probs).max() < tol, freq
    # On rejection the emitted token follows norm(max(p - q, 0)): p without the draft.
    rejected = first[accepted == 0]
    residual = np.where(np.arange(len(probs)) == draft, 0.0, probs)
    residual /= residual.sum()
    freq = np.bincount(rejected, minlength=len(probs)) / len(rejected)
    assert np.abs(freq - residual).max() < 5 * 0.5 / np.sqrt(len(rejected)), freq
    assert not (rejected == draft).any()
    # After an accepted draft the bonus token is an independent draw from p.
    bonus = sampled[accepted == 1, 1]
    freq = np.bincount(bonus, minlength=len(probs)) / len(bonus)
    assert np.abs(freq - probs).max() < 5 * 0.5 / np.sqrt(len(bonus)), freq
