"""Per-request worker state and the persistent batch it lives in.

The scheduler sends diffs, so the worker keeps each request's tokens, block table and
sampling parameters in row-major numpy arrays whose rows stay put from step to step
(removals are filled from the end, ``condense``). ``token_ids[row, :num_tokens]`` is prompt
+ outputs; under async scheduling an output not yet on the host is ``-1`` until something
needs its value (docs/architecture.md §3 rule 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from raylm.runner.sample.rng import to_int64_seed
from raylm.scheduler.lora import LoRARequest
from raylm.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    seed: int
    output_token_ids: list[int] = field(default_factory=list)  # -1 = still on the device
    # Tokens that must not be sampled before ``min_tokens`` outputs (stop ids + EOS).
    min_tokens_stop_ids: tuple[int, ...] = ()
    row: int | None = None  # row in the InputBatch; None once the request is dropped
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)
    # Hybrid models (runner/state_cache.py): its group of Mamba2 state slots, and the
    # position whose state its first slot holds
    state_group: int = -1
    state_base: int = -1
    # The snapshot slot its first step reads its state from (a prefix hit), -1: none
    state_snapshot: int = -1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputBatch:
    # One row per request, made and grown by _grow (set by name there).
    token_ids: np.ndarray  # [rows, max_model_len] int32: prompt + outputs
    block_table: np.ndarray  # [rows, max_num_blocks_per_req] int32
    num_tokens: np.ndarray  # [rows] int64
    num_prompt_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    num_blocks: np.ndarray
    top_k: np.ndarray
    seeds: np.ndarray
    min_tokens: np.ndarray
    lora_ids: np.ndarray
    last_sampled_pos: np.ndarray
    num_logprobs: np.ndarray
    temperature: np.ndarray  # [rows] float32
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    is_greedy: np.ndarray  # [rows] bool
    needs_history: np.ndarray

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 num_kv_groups: int = 1) -> None:
        self.max_model_len = max_model_len
        # Several KV cache groups: each logical block's ids, one per group, side by side.
        self.num_kv_groups = num_kv_groups
        self.max_num_blocks_per_req = -(-max_model_len // block_size) * num_kv_groups
        self.num_reqs = 0
        self.req_ids: list[str] = []
        self.states: list[CachedRequestState] = []
        self.req_id_to_index: dict[str, int] = {}
        self._capacity = 0
        self._grow(max(1, max_num_reqs))
        # Async scheduling (vLLM's names): the previous step's sampled ids, still on the
        # device ([B_prev, 1] tensor), and the row of each request that sampled in them.
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_index: dict[str, int] = {}

    def _grow(self, capacity: int) -> None:
        def grow(name: str, shape: tuple[int, ...], dtype: type[np.generic], fill: float) -> None:
            new = np.full((capacity, *shape), fill, dtype=dtype)
            if self._capacity:
                new[: self._capacity] = getattr(self, name)
            setattr(self, name, new)

        grow("token_ids", (self.max_model_len,), np.int32, 0)
        grow("block_table", (self.max_num_blocks_per_req,), np.int32, 0)
        for name in ("num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_blocks",
                     "top_k", "seeds", "min_tokens"):
            grow(name, (), np.int64, 0)
        grow("lora_ids", (), np.int64, 0)  # each row's adapter id (0: the base model)
        grow("last_sampled_pos", (), np.int64, -1)  # position of the newest sampled token
        grow("num_logprobs", (), np.int64, -1)  # -1: no logprobs
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            grow(name, (), np.float32, 0.0)
        grow("is_greedy", (), np.bool_, False)
        grow("needs_history", (), np.bool_, False)
        self._capacity = capacity

    # ---------------------------------------------------------------- membership
    def add_request(self, state: CachedRequestState) -> int:
        if self.num_reqs == self._capacity:
            self._grow(2 * self._capacity)
        row = self.num_reqs
        self.num_reqs += 1
        num_prompt = state.num_prompt_tokens
        num_tokens = num_prompt + len(state.output_token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has {num_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}.")
        self.token_ids[row, :num_prompt] = state.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = state.output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, state.block_ids)
        self.last_sampled_pos[row] = -1
        self.lora_ids[row] = 0 if state.lora_request is None else state.lora_request.lora_int_id
        sp = state.sampling_params
        greedy = sp.temperature < 1e-5
        self.is_greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.repetition_penalty[row] = sp.repetition_penalty
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.needs_history[row] = sp.needs_output_history
        self.seeds[row] = to_int64_seed(state.seed)
        self.min_tokens[row] = sp.min_tokens
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.req_id_to_index[state.req_id] = row
        state.row = row
        return row

    def remove_requests(self, req_ids: set[str]) -> None:
        """Drop rows, then fill the holes with the last rows (order changes only then)."""
        holes = sorted(self.req_id_to_index.pop(r) for r in req_ids if r in self.req_id_to_index)
        for row in holes:
            self.states[row].row = None
        last = self.num_reqs - 1
        removed = set(holes)
        for hole in holes:
            while last in removed and last > hole:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            removed.add(last)
            last -= 1
        self.num_reqs -= len(holes)
        del self.req_ids[self.num_reqs:]
        del self.states[self.num_reqs:]

    def _move_row(self, src: int, dst: int) -> None:
        for name in ("num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_blocks",
                     "top_k", "seeds", "min_tokens", "last_sampled_pos", "num_logprobs",
                     "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "is_greedy", "needs_history", "lora_ids"):
            arr = getattr(self, name)
            arr[dst] = arr[src]
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        state = self.states[src]
        self.req_ids[dst], self.states[dst] = state.req_id, state
        self.req_id_to_index[state.req_id] = dst
        state.row = dst

    # ---------------------------------------------------------------- per-row updates
    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"request {self.req_ids[row] if row < len(self.req_ids) else row!r} "
                             f"would hold {end} blocks, more than max_model_len allows "
                             f"({self.max_num_blocks_per_req}).")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray | None) -> np.ndarray:
        """Append one token per row (``None``: a -1 placeholder each); returns positions."""
        positions = self.num_tokens[rows].copy()
        if (positions >= self.max_model_len).any():
            raise ValueError(f"sampling past max_model_len={self.max_model_len} "
                             f"(positions {positions.tolist()}).")
        values = PLACEHOLDER_TOKEN_ID if token_ids is None else token_ids
        self.token_ids[rows, positions] = values
        self.num_tokens[rows] = positions + 1
        self.last_sampled_pos[rows] = positions
        listed = [PLACEHOLDER_TOKEN_ID] * len(rows) if token_ids is None else token_ids.tolist()
        for row, token in zip(rows.tolist(), listed, strict=True):
            self.states[row].output_token_ids.append(token)
        return positions

    def receive_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Output ids at sequence positions [start, start + len) sent by the scheduler (for
        ranks that did not sample them): known positions are overwritten (settling any
        placeholder), the position right after the history is appended."""
        state = self.states[row]
        num_prompt = state.num_prompt_tokens
        out = state.output_token_ids
        for position, token in enumerate(token_ids, start):
            index = position - num_prompt
            if index < 0 or index > len(out):
                raise ValueError(f"request {state.req_id!r}: new token at position {position} "
                                 f"outside its outputs [{num_prompt}, {num_prompt + len(out)}].")
            if index == len(out):
                if position >= self.max_model_len:
                    raise ValueError(f"request {state.req_id!r}: position {position} is past "
                                     f"max_model_len={self.max_model_len}.")
                out.append(token)
                self.num_tokens[row] += 1
            else:
                out[index] = token
            self.token_ids[row, position] = token

    @staticmethod
    def fill_placeholder(state: CachedRequestState, position: int, token_id: int,
                         token_ids: np.ndarray) -> None:
        """Settle the placeholder at sequence ``position`` of ``state``, if it is still there.
        Hazard: the request may have finished or been preempted while its step was in
        flight; then ``state.row`` is None (or the state was replaced) and nothing is written."""
        if state.row is None:
            return
        index = position - state.num_prompt_tokens
        if 0 <= index < len(state.output_token_ids) and \
                state.output_token_ids[index] == PLACEHOLDER_TOKEN_ID:
            state.output_token_ids[index] = token_id
            token_ids[state.row, position] = token_id
