"""Build the Sampler's per-row tensors for one step from the InputBatch's numpy columns.

A feature that no row of the step uses stays ``None`` and costs nothing on the device.
Penalties read the token history; under async scheduling the newest entries may be -1
placeholders, which ``settle_placeholders`` replaces with real ids first (the one place
async mode waits on a previous step's device->host copy).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from raylm.runner.input_batch import PLACEHOLDER_TOKEN_ID, InputBatch
from raylm.runner.prepare_inputs import StepBatch
from raylm.runner.sample.sampler import SamplingMetadata


def build_sampling_metadata(ib: InputBatch, batch: StepBatch, vocab_size: int,
                            device: torch.device,
                            settle_placeholders: Callable[[], None]) -> SamplingMetadata:
    def to(array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)

    rows = batch.rows
    is_greedy = ib.is_greedy[rows]
    all_greedy = bool(is_greedy.all())
    all_random = not bool(is_greedy.any())
    md = SamplingMetadata(
        temperature=None if all_greedy else to(ib.temperature[rows]),
        all_greedy=all_greedy, all_random=all_random,
        is_greedy=None if all_greedy or all_random else to(is_greedy),
        top_k=None, top_p=None, min_p=None,
        seeds=None if all_greedy else to(ib.seeds[rows]),
        positions=None if all_greedy else to(batch.seq_lens.astype(np.int64)),
    )
    if not all_greedy:
        top_k, top_p, min_p = ib.top_k[rows], ib.top_p[rows], ib.min_p[rows]
        if (top_k > 0).any():
            md.top_k = to(top_k)
            md.max_top_k = int(np.where(top_k > 0, top_k, vocab_size).max())
        md.top_p = to(top_p) if (top_p < 1.0).any() else None
        md.min_p = to(min_p) if (min_p > 0.0).any() else None
    num_prompt = ib.num_prompt_tokens[rows]
    if ib.needs_history[rows].any():
        _add_penalties(md, ib, batch, num_prompt, vocab_size, to, settle_placeholders)
    num_outputs_before = batch.seq_lens - num_prompt
    banned = np.flatnonzero(batch.sample_mask & (ib.min_tokens[rows] > num_outputs_before))
    if banned.size:
        pairs = [(i, t) for i in banned.tolist()
                 for t in ib.states[int(rows[i])].min_tokens_stop_ids]
        if pairs:
            md.banned_rows = to(np.array([p[0] for p in pairs], np.int64))
            md.banned_tokens = to(np.array([p[1] for p in pairs], np.int64))
    _add_logit_bias(md, ib, rows, to)
    num_logprobs = ib.num_logprobs[rows]
    if (num_logprobs >= 0).any():
        md.max_num_logprobs = int(num_logprobs.max())
    return md


def _add_logit_bias(md: SamplingMetadata, ib: InputBatch, rows: np.ndarray,
                    to: Callable[[np.ndarray], torch.Tensor]) -> None:
    """Every row of a request with a logit_bias (each verified position, with speculative
    decoding) gets its biases."""
    states = ib.states
    biased = [(i, bias) for i, r in enumerate(rows.tolist())
              if (bias := states[r].sampling_params.logit_bias)]
    if not biased:
        return
    md.bias_rows = to(np.array([i for i, bias in biased for _ in bias], np.int64))
    md.bias_tokens = to(np.array([t for _, bias in biased for t in bias], np.int64))
    md.bias_values = to(np.array([v for _, bias in biased for v in bias.values()], np.float32))


def _add_penalties(md: SamplingMetadata, ib: InputBatch, batch: StepBatch,
                   num_prompt: np.ndarray, vocab_size: int,
                   to: Callable[[np.ndarray], torch.Tensor],
                   settle_placeholders: Callable[[], None]) -> None:
    rows = batch.rows
    needs = ib.needs_history[rows]
    prompt_cols = np.arange(int(num_prompt.max()))
    prompt = ib.token_ids[rows[:, None], prompt_cols[None, :]]
    prompt = np.where(prompt_cols[None, :] < num_prompt[:, None], prompt, vocab_size)

    def outputs() -> np.ndarray:
        # History before the token being sampled: positions [num_prompt, seq_len).
        width = max(int((batch.seq_lens - num_prompt).max()), 1)
        cols = num_prompt[:, None] + np.arange(width)[None, :]
        valid = cols < batch.seq_lens[:, None]
        tokens = ib.token_ids[rows[:, None], np.minimum(cols, ib.max_model_len - 1)]
        return np.where(valid, tokens, vocab_size)

    out = outputs()
    if ((out == PLACEHOLDER_TOKEN_ID) & needs[:, None]).any():
        settle_placeholders()
        out = outputs()
        missing = (out == PLACEHOLDER_TOKEN_ID) & needs[:, None]
        if missing.any():
            raise RuntimeError(f"penalty rows {np.flatnonzero(missing.any(1)).tolist()} still "
                               "hold placeholder tokens after settling.")
    # Rows without penalties may keep placeholders; they only need a valid (padding) index.
    out = np.where(out < 0, vocab_size, out)
    md.repetition_penalties = to(ib.repetition_penalty[rows])
    md.presence_penalties = to(ib.presence_penalty[rows])
    md.frequency_penalties = to(ib.frequency_penalty[rows])
    md.prompt_token_ids = to(prompt.astype(np.int64))
    md.output_token_ids = to(out.astype(np.int64))
