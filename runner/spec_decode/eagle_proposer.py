"""Drafts from an EAGLE head (runner/models/eagle_head.py) or an MTP layer
(runner/models/mtp_head.py) reading the target's hidden states, made right after each
verification for the request's next step.

The head's KV at position p is that of the pair (token p + 1, the target's feature at p).
Every step, after verification, the head runs over every position the target verified in
that step (all of a prefill chunk's; a sampling row's up to its last accepted token, paired
with the tokens after them, the bonus token last), so its KV never falls behind and needs
no features kept between steps. Then the requests that want drafts chain k - 1 more
single-token forwards, each fed the previous draft and the head's own output as the
feature. Its KV uses the target's block table (the scheduler books the slots the chain
writes past the step's, as for a draft model: ``num_lookahead_tokens``)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import VocabParallelEmbedding, process_weights_after_loading
from raylm.runner.attention.paged_attention import allocate_kv_cache, resolve_attention_backend
from raylm.runner.input_batch import InputBatch
from raylm.runner.loading.model_loader import iterate_weights, resolve_dtype, safetensors_files
from raylm.runner.models.eagle_head import EagleHead, EagleHeadConfig
from raylm.runner.models.llama import LlamaForCausalLM
from raylm.runner.models.mtp_head import MTPHead, mtp_layout
from raylm.runner.prepare_inputs import StepBatch, upload
from raylm.runner.spec_decode.draft_proposer import DraftRequest, draft_attention_inputs
from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import EngineConfig


def head_tensor_names(path: str) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names.extend(f.keys())
    return names


class EagleProposer:
    def __init__(self, engine_config: EngineConfig, input_batch: InputBatch,
                 device: torch.device) -> None:
        spec = engine_config.speculative_config
        assert spec is not None and spec.model is not None
        self.method = spec.method
        self.path = spec.model
        self.target_config = engine_config.model_config
        self.block_size = engine_config.cache_config.block_size
        self.input_batch = input_batch
        self.device = device
        self.dtype = resolve_dtype(self.target_config.dtype, device,
                                   self.target_config.hf_config)
        self.attention_backend = resolve_attention_backend(device)
        self.head: EagleHead | MTPHead | None = None
        self.target: LlamaForCausalLM | None = None

    # ---------------------------------------------------------------- setup
    def load_model(self, ctx: ParallelContext, target: LlamaForCausalLM) -> None:
        max_len = self.target_config.max_model_len
        head: EagleHead | MTPHead
        if self.method == "mtp":
            target_hf = self.target_config.hf_config
            layout = mtp_layout(target_hf, head_tensor_names(self.path))
            head = MTPHead(target_hf, layout, target, ctx, self.dtype,
                           max(int(target_hf.get("max_position_embeddings", 0)), max_len))
            head.load_weights(iterate_weights(self.path, wanted=head.wants))
        else:
            with open(os.path.join(self.path, "config.json")) as f:
                head_hf = json.load(f)
            cfg = EagleHeadConfig.from_hf(self.method, head_hf, self.target_config.hf_config,
                                          head_tensor_names(self.path))
            head = EagleHead(cfg, target, ctx, self.dtype,
                             max(cfg.decoder.max_position_embeddings, max_len))
            head.load_weights(iterate_weights(self.path))
            assert target.model.aux_hidden_layers == cfg.aux_layers  # the Speculator's
        if head.embed_tokens is None and not ctx.is_first_pp_rank:
            head.embed_tokens = self._target_embedding(ctx)
        process_weights_after_loading(head, envs.cpu_pack_linears())  # as the target's
        self.head = head.eval()
        self.target = target

    def _target_embedding(self, ctx: ParallelContext) -> VocabParallelEmbedding:
        """A copy of the target's embedding for a last stage that has none (PP): the head
        embeds the tokens it drafts from."""
        hf = self.target_config.hf_config
        embed = VocabParallelEmbedding(int(hf["vocab_size"]), int(hf["hidden_size"]), ctx=ctx,
                                       params_dtype=self.dtype)
        name = "model.embed_tokens.weight"
        param = embed.weight
        for _, tensor in iterate_weights(self.target_config.model, wanted=name.__eq__):
            param.weight_loader(param, tensor)  # type: ignore[attr-defined]
            return embed
        raise ValueError(f"speculative_config.method {self.method!r} on a pipeline stage "
                         f"needs the target's {name} in its safetensors files.")

    @property
    def loaded_head(self) -> EagleHead | MTPHead:
        if self.head is None:
            raise RuntimeError("the EAGLE head is not loaded; call load_model() first.")
        return self.head

    def kv_cache_bytes_per_block(self) -> int:
        return sum(a.cache_bytes_per_block(self.block_size, self.dtype)
                   for a in self.loaded_head.attention_layers)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for attn in self.loaded_head.attention_layers:
            attn.kv_cache = allocate_kv_cache(num_blocks, self.block_size, attn.num_kv_heads,
                                              attn.head_dim, self.dtype, self.device,
                                              attn.latent_cache)

    # ---------------------------------------------------------------- per step
    @torch.inference_mode()
    def step(self, batch: StepBatch, hidden: torch.Tensor, sampling: np.ndarray,
             wanted: list[DraftRequest]) -> torch.Tensor:
        """After verification (the history holds each sampling row's run): the head over
        the step's verified positions of every row, then the chain of the ``wanted``
        requests (each one of the ``sampling`` rows). Returns their drafts
        ``[len(wanted), max(max_drafts)]`` on the device (zeros past a row's own count)."""
        head, ib = self.loaded_head, self.input_batch
        width = max((r.max_drafts for r in wanted), default=0)
        drafts = torch.zeros((len(wanted), width), dtype=torch.int64, device=self.device)
        ends = np.cumsum(batch.num_scheduled)
        starts = batch.seq_lens - batch.num_scheduled  # the step's first position per row
        sampled = np.zeros(len(batch.req_ids), bool)
        sampled[sampling] = True
        # Positions whose target hidden state stands: a prefill chunk's all; a sampling
        # row's up to the token before the newest (the bonus has no hidden state yet).
        counts = np.where(sampled, ib.num_tokens[batch.rows] - 1 - starts, batch.num_scheduled)
        keep = counts > 0
        rows, first, counts = batch.rows[keep], starts[keep], counts[keep]
        if rows.size == 0:
            return drafts
        hidden_index = np.concatenate([np.arange(e - n, e - n + c) for e, n, c in zip(
            ends[keep], batch.num_scheduled[keep], counts)])
        tokens = np.concatenate([ib.token_ids[r, s + 1:s + 1 + c]
                                 for r, s, c in zip(rows.tolist(), first.tolist(),
                                                    counts.tolist())])
        aux = self.target.model.aux_hidden_states if self.target is not None else []
        feature = head.feature(hidden, aux, self._dev(hidden_index))
        positions, meta = draft_attention_inputs(ib, rows, first, counts, self.block_size,
                                                 self.attention_backend, self.device)
        out = head(self._dev(tokens), positions, feature, meta)
        if not wanted:
            return drafts
        # Each wanted request's last pair: the feature its first draft comes from.
        last = np.cumsum(counts) - 1
        slot_of_row = {int(r): int(i) for i, r in enumerate(rows.tolist())}
        order = np.array([last[slot_of_row[r.row]] for r in wanted], np.int64)
        out = out.index_select(0, self._dev(order))
        active = np.arange(len(wanted))
        wanted_rows = np.array([r.row for r in wanted], np.int64)
        position = np.array([r.num_tokens - 2 for r in wanted], np.int64)
        step = 0
        while True:
            token_ids = head.next_tokens(out)
            drafts[self._dev(active), step] = token_ids
            step += 1
            more = np.array([wanted[i].max_drafts > step for i in active.tolist()], bool)
            if not more.any():
                return drafts
            keep_dev = self._dev(np.flatnonzero(more))
            active, token_ids, out = active[more], token_ids[keep_dev], out[keep_dev]
            position = position[more] + 1
            chain_positions, chain_meta = draft_attention_inputs(
                ib, wanted_rows[active], position, np.ones(active.size, np.int64),
                self.block_size, self.attention_backend, self.device)
            out = head(token_ids, chain_positions, out, chain_meta)

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return upload(np.ascontiguousarray(array, dtype=np.int64), self.device)
