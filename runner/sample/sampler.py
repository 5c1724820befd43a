"""Batched sampling over full-vocabulary float32 logits, vLLM's order of operations.

raw logprobs (if asked) -> min_tokens mask -> logit_bias -> penalties -> greedy argmax |
(temperature -> min_p -> top_k/top_p -> Gumbel-max with the position-keyed hash RNG of
``rng``).

Per-row parameters are tensors; a feature no row uses is ``None`` and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.runner.sample import rng


@dataclass
class SamplingMetadata:
    # temperature, seeds and positions are None when every row is greedy.
    temperature: torch.Tensor | None  # [B] float32; 1.0 on greedy rows (never divided by 0)
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None  # [B] bool; None when all rows agree
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off
    seeds: torch.Tensor | None  # [B] int64
    positions: torch.Tensor | None  # [B] int64: sequence index of the token being sampled
    # Penalties (None when no row uses any): token ids padded with vocab_size.
    repetition_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None  # [B]
    frequency_penalties: torch.Tensor | None = None  # [B]
    prompt_token_ids: torch.Tensor | None = None  # [B, Lp]
    output_token_ids: torch.Tensor | None = None  # [B, Lo]
    # min_tokens: (row, token) pairs forced to -inf (stop tokens before min_tokens outputs).
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    # logit_bias: (row, token, bias) triples added to the logits (OpenAI's and vLLM's
    # semantics: before penalties and sampling, after the raw logprobs).
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    max_num_logprobs: int | None = None  # top-n width; None = no row wants logprobs
    # The widest top-k of the step, computed on the host: reading it from the device tensor
    # would synchronize the stream every sampled step.
    max_top_k: int | None = None

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None


@dataclass
class LogprobsTensors:
    logprob_token_ids: torch.Tensor  # [B, n + 1] int64: sampled, then top-1 .. top-n
    logprobs: torch.Tensor  # [B, n + 1] float32
    selected_token_ranks: torch.Tensor  # [B] int64, 1 = the most likely token


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B, 1] int64
    logprobs_tensors: LogprobsTensors | None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self._vocab_keys = rng.vocab_keys(vocab_size, device)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            # vLLM's default: logprobs of the model's raw distribution, before any processing.
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if md.banned_rows is not None:
            logits[md.banned_rows, md.banned_tokens] = float("-inf")
        if md.bias_rows is not None:
            assert md.bias_tokens is not None and md.bias_values is not None  # set together
            logits.index_put_((md.bias_rows, md.bias_tokens), md.bias_values.to(logits.dtype),
                              accumulate=True)
        if not md.no_penalties:
            logits = apply_penalties(logits, md, self.vocab_size)
        sampled = self._sample(logits, md).unsqueeze(1)
        logprobs = None
        if raw_logprobs is not None and md.max_num_logprobs is not None:  # set together
            logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return logits.argmax(dim=-1)
        greedy = None if md.all_random else logits.argmax(dim=-1)
        # Set whenever a row samples at random.
        assert md.temperature is not None and md.seeds is not None and md.positions is not None
        logits = logits / md.temperature[:, None]
        if md.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * md.min_p[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
        noise = rng.gumbel_noise(rng.row_keys(md.seeds, md.positions), self._vocab_keys)
        random = (logits + noise).argmax(dim=-1)
        if greedy is None:
            return random
        assert md.is_greedy is not None  # set when rows are both greedy and random
        return torch.where(md.is_greedy, greedy, random)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with ``vocab_size`` -> [B, V] occurrence counts."""
    counts = torch.zeros((token_ids.shape[0], vocab_size + 1), dtype=torch.int32,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata, vocab_size: int) -> torch.Tensor:
    """Repetition penalty as HF (over prompt + output: positive logits divided, others
    multiplied); presence and frequency penalties as vLLM/OpenAI (over output tokens)."""
    # _add_penalties sets them all together.
    assert (md.output_token_ids is not None and md.prompt_token_ids is not None
            and md.repetition_penalties is not None and md.presence_penalties is not None
            and md.frequency_penalties is not None)
    output_counts = token_counts(md.output_token_ids, vocab_size)
    seen = output_counts > 0
    prompt_seen = token_counts(md.prompt_token_ids, vocab_size) > 0
    rep = md.repetition_penalties[:, None].expand_as(logits)
    rep = torch.where(seen | prompt_seen, rep, torch.ones_like(rep))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalties[:, None] * output_counts
    return logits - md.presence_penalties[:, None] * seen


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int | None = None) -> torch.Tensor:
    """Mask to -inf everything outside each row's top-k, then outside the smallest set
    whose probability reaches top-p (the most likely token always survives).
    ``max_top_k``: the largest effective k (0 counts as the vocabulary), known on the host;
    without it the device tensor is read, a stream synchronization."""
    vocab = logits.shape[-1]
    if top_p is None:
        # Only top-k: a partial topk is cheaper than a full sort.
        assert top_k is not None, "apply_top_k_top_p needs top_k or top_p"
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        max_k = min(max_top_k, vocab) if max_top_k is not None else int(k.max())
        values = logits.topk(max_k, dim=-1).values
        threshold = values.gather(1, (k - 1).clamp(max=max_k - 1)[:, None])
        threshold = threshold.masked_fill((top_k <= 0)[:, None], float("-inf"))
        return logits.masked_fill(logits < threshold, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    exclusive_cumsum = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(exclusive_cumsum >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                    num_logprobs: int) -> LogprobsTensors:
    """Sampled token's logprob and rank, plus the top-``num_logprobs`` (ids, logprobs)."""
    sampled_logprob = raw_logprobs.gather(1, sampled)
    ranks = (raw_logprobs >= sampled_logprob).sum(dim=-1)
    ids, values = sampled, sampled_logprob
    if num_logprobs > 0:
        top = raw_logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat((sampled, top.indices), dim=1)
        values = torch.cat((sampled_logprob, top.values), dim=1)
    return LogprobsTensors(ids, values, ranks)
