"""Drafts from a smaller model with the target's vocabulary, run on the same rank.

Its KV cache has as many blocks as the target's and uses the target's block table, so it
needs no allocator. A proposal first catches up on the tokens the draft model has not
seen, then drafts greedily, one forward per draft shared by every request, each argmax fed
back on the device. Greedy drafts are point masses, as rejection_sampler.py expects.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from raylm.parallel.context import ParallelContext
from raylm.runner.attention.paged_attention import (
    AttentionMetadata,
    allocate_kv_cache,
    build_attention_metadata,
    resolve_attention_backend,
)
from raylm.runner.input_batch import InputBatch
from raylm.runner.loading.model_loader import get_model, resolve_dtype
from raylm.runner.models.llama import LlamaForCausalLM
from raylm.runner.prepare_inputs import upload
from raylm.scheduler.config.engine_config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class DraftRequest:
    req_id: str
    row: int  # InputBatch row
    num_tokens: int  # known tokens; the drafts follow them
    max_drafts: int
    # Right after a verification: the run it emitted (positions from ``run_start`` to
    # ``num_tokens``) is read from the sampler's output on the device, from ``run_offset``
    # on, not from the host history. -1: all from the history.
    run_start: int = -1
    run_offset: int = -1


class DraftModelProposer:
    def __init__(self, engine_config: EngineConfig, input_batch: InputBatch,
                 device: torch.device) -> None:
        spec = engine_config.speculative_config
        assert spec is not None and spec.model is not None
        target = engine_config.model_config
        self.model_config = ModelConfig(model=spec.model, dtype=target.dtype,
                                        max_model_len=target.max_model_len, seed=target.seed,
                                        enforce_eager=target.enforce_eager,
                                        compile_fused_ops=target.compile_fused_ops)
        self.block_size = engine_config.cache_config.block_size
        self.input_batch = input_batch
        self.device = device
        self.dtype = resolve_dtype(self.model_config.dtype, device)
        self.attention_backend = resolve_attention_backend(device)
        self.model: LlamaForCausalLM | None = None
        self.num_computed: dict[str, int] = {}

    # ---------------------------------------------------------------- setup
    def load_model(self, ctx: ParallelContext) -> None:
        # Pipeline parallelism: every stage runs the whole draft model (sharded over its
        # TP group only). The drafts fix the step's query lengths, which each stage needs
        # before its forward; drafting on every stage from the same history gives every
        # stage the same drafts with no message from the last stage, for the price of
        # a small model's forwards repeated per stage.
        self.model = get_model(self.model_config, replace(ctx, pp_rank=0, pp_size=1,
                                                          pp_group=None))

    @property
    def loaded_model(self) -> LlamaForCausalLM:
        """The draft model, once load_model has run."""
        if self.model is None:
            raise RuntimeError("the draft model is not loaded; call load_model() first.")
        return self.model

    def kv_cache_bytes_per_block(self) -> int:
        return sum(a.cache_bytes_per_block(self.block_size, self.dtype)
                   for a in self.loaded_model.attention_layers)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for attn in self.loaded_model.attention_layers:
            attn.kv_cache = allocate_kv_cache(num_blocks, self.block_size, attn.num_kv_heads,
                                              attn.head_dim, self.dtype, self.device,
                                              attn.latent_cache)

    # ---------------------------------------------------------------- per step
    def forget(self, req_id: str) -> None:
        self.num_computed.pop(req_id, None)

    def on_verified(self, req_id: str, num_tokens: int) -> None:
        """After verification: draft KV past the accepted tokens is not the request's."""
        if req_id in self.num_computed:
            self.num_computed[req_id] = min(self.num_computed[req_id], num_tokens - 1)

    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest], runs: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Greedy drafts ``[len(reqs), max(max_drafts)]`` on the device: row i holds
        ``reqs[i]``'s first ``max_drafts`` drafts (the rest of the row is 0). ``runs``:
        the verified tokens on the device that requests with a ``run_start`` read their
        newest tokens from. Each draft forward feeds the previous one's argmax straight
        back, so the loop never waits for the host; the caller copies the drafts out when
        it needs them."""
        width = max((r.max_drafts for r in reqs), default=0)
        drafts = torch.zeros((len(reqs), width), dtype=torch.int64, device=self.device)
        # Step 0 catches up on the unseen known tokens; step j > 0 feeds draft j - 1.
        active = np.array([i for i, r in enumerate(reqs) if r.max_drafts > 0], np.int64)
        if active.size == 0:
            return drafts
        starts = np.array([min(self.num_computed.get(reqs[i].req_id, 0), reqs[i].num_tokens - 1)
                           for i in active.tolist()], np.int64)
        rows = np.array([reqs[i].row for i in active.tolist()], np.int64)
        q_lens = np.array([reqs[i].num_tokens for i in active.tolist()], np.int64) - starts
        token_ids = self._catch_up_tokens([reqs[i] for i in active.tolist()], starts, runs)
        step = 0
        while active.size:
            token_ids = self._forward(rows, starts, q_lens, token_ids)
            drafts[self._dev(active), step] = token_ids
            for i, end in zip(active.tolist(), (starts + q_lens).tolist()):
                self.num_computed[reqs[i].req_id] = end
            step += 1
            keep = np.array([reqs[i].max_drafts > step for i in active.tolist()], bool)
            active, rows = active[keep], rows[keep]
            token_ids = token_ids[self._dev(np.flatnonzero(keep))]
            starts = np.array([reqs[i].num_tokens + step - 1 for i in active.tolist()], np.int64)
            q_lens = np.ones(active.size, np.int64)
        return drafts

    def _catch_up_tokens(self, reqs: list[DraftRequest], starts: np.ndarray,
                         runs: torch.Tensor | None) -> torch.Tensor:
        """The tokens from ``starts[i]`` to ``reqs[i].num_tokens`` of every request, on
        the device, in order: from the host history, except a verified run, which comes
        from ``runs`` on the device."""
        ib = self.input_batch
        # Per token, in order: its index in the host part, or -1 - its index in ``runs``.
        host_parts, order = [], []
        num_host = 0
        for r, start in zip(reqs, starts.tolist()):
            split = r.num_tokens if runs is None or r.run_start < 0 else max(start, r.run_start)
            host_parts.append(ib.token_ids[r.row, start:split])
            order.append(np.arange(num_host, num_host + split - start))
            num_host += split - start
            if split < r.num_tokens:
                order.append(-1 - (r.run_offset + np.arange(split - r.run_start,
                                                            r.num_tokens - r.run_start)))
        host = self._dev(np.concatenate(host_parts).astype(np.int64))
        if runs is None or num_host == sum(len(o) for o in order):
            return host
        index = np.concatenate(order)
        index = np.where(index >= 0, index, num_host - 1 - index)  # device part after host
        return torch.cat((host, runs)).index_select(0, self._dev(index))

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return upload(array, self.device)

    def _forward(self, rows: np.ndarray, starts: np.ndarray, q_lens: np.ndarray,
                 token_ids: torch.Tensor) -> torch.Tensor:
        """One draft forward: row i (InputBatch row ``rows[i]``) feeds ``q_lens[i]`` of
        ``token_ids`` at positions from ``starts[i]``; the greedy next token of each row,
        on the device."""
        positions, meta = draft_attention_inputs(self.input_batch, rows, starts, q_lens,
                                                 self.block_size, self.attention_backend,
                                                 self.device)
        model = self.loaded_model
        hidden = model(token_ids, positions, meta, None)
        cu = np.cumsum(q_lens)
        logits = model.compute_logits(hidden.index_select(0, self._dev(cu - 1)))
        return logits.argmax(dim=-1)


def draft_attention_inputs(ib: InputBatch, rows: np.ndarray, starts: np.ndarray,
                           q_lens: np.ndarray, block_size: int, backend: str,
                           device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and attention metadata of a drafter's forward on the target's block
    table: row i (InputBatch row ``rows[i]``) runs ``q_lens[i]`` tokens from position
    ``starts[i]``, writing its own KV at those positions' slots."""
    cu = np.concatenate(([0], np.cumsum(q_lens)))
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, q_lens)])
    token_rows = np.repeat(rows, q_lens)
    block_ids = ib.block_table[token_rows, positions // block_size].astype(np.int64)
    slots = block_ids * block_size + positions % block_size
    seq_lens = starts + q_lens
    max_blocks = -(-int(seq_lens.max()) // block_size)
    # The block table stays on the host: the metadata builders read it there.
    meta = build_attention_metadata(cu, seq_lens, upload(slots, device),
                                    ib.block_table[rows, :max_blocks].astype(np.int64),
                                    block_size, backend=backend)
    return upload(positions, device), meta
