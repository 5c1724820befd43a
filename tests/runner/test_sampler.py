"""Sampler and the stateless RNG: batch invariance, masks, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from raylm.runner.sample import rng
from raylm.runner.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p

V = 50


def _md(n: int, *, temperature=1.0, top_k=None, top_p=None, min_p=None, seeds=None,
        positions=None, greedy=None, **extra) -> SamplingMetadata:
    greedy = torch.zeros(n, dtype=torch.bool) if greedy is None else torch.tensor(greedy)
    temp = torch.full((n,), float(temperature)) if not isinstance(temperature, list) \
        else torch.tensor(temperature)
    temp = torch.where(greedy, torch.ones_like(temp), temp)
    return SamplingMetadata(
        temperature=temp, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
        is_greedy=greedy, top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        seeds=torch.tensor(seeds if seeds is not None else [7] * n),
        positions=torch.tensor(positions if positions is not None else list(range(n))),
        **extra)


def test_seeded_sample_is_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g) * 2
    sampler = Sampler(V, torch.device("cpu"))
    seeds, positions = [11, 12, 13, 14, 15, 16], [3, 9, 9, 40, 2, 5]
    batch = sampler(logits.clone(), _md(6, seeds=seeds, positions=positions,
                                        top_k=[0, 5, 0, 0, 3, 0], top_p=[1.0, 1.0, 0.9, 1.0, 1.0, 0.8]))
    for i in range(6):
        alone = sampler(logits[i:i + 1].clone(), _md(1, seeds=[seeds[i]], positions=[positions[i]],
                                                      top_k=[[0, 5, 0, 0, 3, 0][i]],
                                                      top_p=[[1.0, 1.0, 0.9, 1.0, 1.0, 0.8][i]]))
        assert alone.sampled_token_ids.item() == batch.sampled_token_ids[i].item()
    # Reordered batch, different neighbours: same tokens.
    order = [5, 2, 0, 4, 1, 3]
    shuffled = sampler(logits[order].clone(), _md(6, seeds=[seeds[i] for i in order],
                                                  positions=[positions[i] for i in order],
                                                  top_k=[[0, 5, 0, 0, 3, 0][i] for i in order],
                                                  top_p=[[1.0, 1.0, 0.9, 1.0, 1.0, 0.8][i] for i in order]))
    assert shuffled.sampled_token_ids[:, 0].tolist() == [batch.sampled_token_ids[i].item() for i in order]


def test_gumbel_sampling_follows_the_softmax_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20000
    logits = probs.log().repeat(n, 1)
    sampler = Sampler(5, torch.device("cpu"))
    out = sampler(logits, _md(n, seeds=[123] * n, positions=list(range(n))))
    freq = torch.bincount(out.sampled_token_ids[:, 0], minlength=5).float() / n
    assert (freq - probs).abs().max() < 0.015, freq


def test_seed_and_position_change_the_draw():
    keys = rng.vocab_keys(1000, torch.device("cpu"))
    u = rng.uniform(rng.row_keys(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1])), keys)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02
    # Stateless: the same key gives the same numbers again; large and negative seeds work.
    again = rng.uniform(rng.row_keys(torch.tensor([1]), torch.tensor([0])), keys)
    assert torch.equal(again[0], u[0])
    big = rng.to_int64_seed(2**70 + 5)
    assert -2**63 <= big < 2**63 and rng.to_int64_seed(-1) == -1


def test_top_k_top_p_min_p_masks():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    inf = float("-inf")
    assert apply_top_k_top_p(logits.clone(), torch.tensor([2]), None).isinf().tolist() == \
        [[False, False, True, True]]
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.7]))
    assert masked.isinf().tolist() == [[False, False, True, True]]
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.79]))
    assert masked.isinf().tolist() == [[False, False, True, True]]
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.81]))
    assert masked.isinf().tolist() == [[False, False, False, True]]
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([1]), torch.tensor([1.0]))
    assert masked[0, 1:].eq(inf).all() and masked[0, 0] == logits[0, 0]
    # Rows without top-k are untouched next to rows with it.
    two = torch.cat([logits, logits])
    out = apply_top_k_top_p(two.clone(), torch.tensor([0, 3]), None)
    assert out[0].isfinite().all() and out[1].isinf().tolist() == [False, False, False, True]
    # Sampling never leaves the allowed set.
    n = 3000
    sampler = Sampler(4, torch.device("cpu"))
    for md_kwargs, allowed in (({"top_k": [2] * n}, {0, 1}), ({"top_p": [0.7] * n}, {0, 1}),
                               ({"min_p": [0.4] * n}, {0, 1})):
        out = sampler(logits.repeat(n, 1), _md(n, positions=list(range(n)), **md_kwargs))
        assert set(out.sampled_token_ids[:, 0].tolist()) == allowed


def test_greedy_rows_take_the_argmax_next_to_random_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    sampler = Sampler(V, torch.device("cpu"))
    out = sampler(logits.clone(), _md(4, temperature=[0.0, 5.0, 0.0, 5.0],
                                      greedy=[True, False, True, False]))
    argmax = logits.argmax(-1)
    assert out.sampled_token_ids[0].item() == argmax[0].item()
    assert out.sampled_token_ids[2].item() == argmax[2].item()


def _reference_penalties(logits, prompt, output, rep, pres, freq):
    out = logits.clone()
    for i in range(out.shape[0]):
        for t in set(prompt[i]) | set(output[i]):
            out[i, t] = out[i, t] / rep[i] if out[i, t] > 0 else out[i, t] * rep[i]
        for t in set(output[i]):
            out[i, t] -= freq[i] * output[i].count(t) + pres[i]
    return out


def test_penalties_match_a_hand_computed_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g) * 3
    prompt = [[1, 2, 2, 3], [4], [5, 6]]
    output = [[3, 7, 7, 7], [], [6, 6, 8]]
    rep, pres, freq = [1.3, 0.7, 1.0], [0.5, 1.0, -0.5], [0.25, 0.0, 1.5]
    expected = _reference_penalties(logits, prompt, output, rep, pres, freq)

    def pad(rows):
        width = max(len(r) for r in rows) or 1
        return torch.tensor([r + [V] * (width - len(r)) for r in rows])

    md = _md(3, temperature=[0.0] * 3, greedy=[True] * 3, repetition_penalties=torch.tensor(rep),
             presence_penalties=torch.tensor(pres), frequency_penalties=torch.tensor(freq),
             prompt_token_ids=pad(prompt), output_token_ids=pad(output))
    from raylm.runner.sample.sampler import apply_penalties

    torch.testing.assert_close(apply_penalties(logits.clone(), md, V), expected)
    out = Sampler(V, torch.device("cpu"))(logits.clone(), md)
    assert out.sampled_token_ids[:, 0].tolist() == expected.argmax(-1).tolist()


def test_min_tokens_bans_stop_tokens():
    logits = torch.zeros(2, V)
    logits[:, 9] = 10.0
    md = _md(2, temperature=[0.0, 0.0], greedy=[True, True], banned_rows=torch.tensor([0]),
             banned_tokens=torch.tensor([9]))
    out = Sampler(V, torch.device("cpu"))(logits, md)
    assert out.sampled_token_ids[:, 0].tolist()[1] == 9
    assert out.sampled_token_ids[0, 0].item() != 9


def test_logprobs_are_raw_and_ranked():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, V, generator=g)
    md = _md(3, temperature=[0.0, 2.0, 2.0], greedy=[True, False, False], max_num_logprobs=4,
             repetition_penalties=torch.tensor([2.0] * 3), presence_penalties=torch.zeros(3),
             frequency_penalties=torch.zeros(3), prompt_token_ids=torch.tensor([[0], [1], [2]]),
             output_token_ids=torch.full((3, 1), V))
    out = Sampler(V, torch.device("cpu"))(logits.clone(), md)
    ref = torch.log_softmax(logits, -1)  # raw: before penalties and temperature
    lp = out.logprobs_tensors
    sampled = out.sampled_token_ids[:, 0]
    assert lp.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, sampled[:, None])[:, 0])
    top = ref.topk(4, dim=-1)
    assert lp.logprob_token_ids[:, 1:].tolist() == top.indices.tolist()
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    for i in range(3):
        rank = int((ref[i] >= ref[i, sampled[i]]).sum())
        assert lp.selected_token_ranks[i].item() == rank
    assert not math.isnan(float(lp.logprobs.sum()))


def _reference_uniform(row_key: int, vocab_key: int) -> float:
    """The documented hash in plain Python integers."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x045D9F3B) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x045D9F3B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    return ((mix(row_key ^ vocab_key) >> 8) + 0.5) / (1 << 24)


def test_uniform_equals_the_hash_in_python_integers():
    """The [B, V] noise runs on int32 with wrapping products; keys with the top bit set
    (negative as int32) must give the same bits as the unsigned hash."""
    row = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0x9E3779B1], dtype=torch.int64)
    vocab = torch.tensor([0, 5, 2**31 + 7, 2**32 - 2, 0x7FFFFFFF], dtype=torch.int64)
    got = rng.uniform(row, vocab)
    want = torch.tensor([[_reference_uniform(r, v) for v in vocab.tolist()]
                         for r in row.tolist()], dtype=torch.float32)
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("seed", [0, 2**40 + 3, -5])
def test_row_keys_are_deterministic_across_calls(seed):
    s = torch.tensor([rng.to_int64_seed(seed)] * 2)
    k1 = rng.row_keys(s, torch.tensor([4, 5]))
    k2 = rng.row_keys(s.clone(), torch.tensor([4, 5]))
    assert torch.equal(k1, k2) and k1[0] != k1[1]
    assert int(k1.min()) >= 0 and int(k1.max()) < 2**32


def test_top_k_width_comes_from_the_host_not_the_device():
    """The step's widest top-k is known on the host: on a device tensor ``int(k.max())``
    would synchronize the stream every step. Meta tensors hold no data, so any read of
    one fails: the masking must run on shapes alone."""
    logits = torch.empty(3, 50, device="meta")
    top_k = torch.empty(3, dtype=torch.int64, device="meta")
    out = apply_top_k_top_p(logits, top_k, None, max_top_k=7)
    assert out.shape == (3, 50) and out.device.type == "meta"
    with pytest.raises((NotImplementedError, RuntimeError)):
        apply_top_k_top_p(logits, top_k, None)  # falls back to reading the device
