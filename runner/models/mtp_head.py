"""DeepSeek-V3's multi-token-prediction layer as a draft head (``method="mtp"``).

The checkpoint's layer L = ``num_hidden_layers`` (its first MTP layer) is a whole decoder
layer of the target's kind (latent attention, sparse experts) behind a fusion:
``eh_proj([enorm(embed(x_{p+1})); hnorm(h_p)])`` with h_p the target's last hidden state
(after its final norm), the embedding zeroed at position 0 as DeepSeek's inference does;
its output, through ``shared_head.norm`` and ``shared_head.head``, gives the draft, and
goes back in as the feature of the next one (one layer chained k times). The layer is built
and loaded by the target's own model class as a one-layer pipeline stage of an (L + 1)-layer
model, so every layer kind the target supports loads the same way. The embedding is the
target's. Same interface as EagleHead (runner/models/eagle_head.py); docs/architecture.md §24.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import replicated_weight_loader
from raylm.runner.attention.paged_attention import Attention, AttentionMetadata
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.fused_ops import EAGER_OPS, FusedOps
from raylm.runner.models.llama import LlamaDecoderLayer, LlamaForCausalLM, make_norm
from raylm.runner.models.mla import ReplicatedLinear
from raylm.runner.rotary import RotaryEmbedding

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# The MTP layer's own tensors, beside the decoder layer's: (checkpoint suffix, where it goes)
_FUSION = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
           "eh_proj.weight": "eh_proj.weight"}
_SHARED_HEAD = {"shared_head.norm.weight": "model.norm.weight",
                "shared_head.head.weight": "lm_head.weight"}


def mtp_layer_index(target_hf: dict[str, Any]) -> int:
    """The checkpoint's first MTP layer, after the decoder's; ValueError when it has none."""
    arch = next(iter(target_hf.get("architectures") or []), "")
    if arch not in MTP_ARCHITECTURES:
        raise ValueError(f"speculative_config.method 'mtp' needs a model with MTP layers "
                         f"{list(MTP_ARCHITECTURES)}; this one is {arch!r}.")
    if int(target_hf.get("num_nextn_predict_layers") or 0) < 1:
        raise ValueError("speculative_config.method 'mtp': the checkpoint's config has "
                         "num_nextn_predict_layers=0 (no MTP layer to draft with).")
    return int(target_hf["num_hidden_layers"])


class MTPHead(nn.Module):
    def __init__(self, target_hf: dict[str, Any], target: LlamaForCausalLM,
                 ctx: ParallelContext, dtype: torch.dtype, max_position: int,
                 ops: FusedOps = EAGER_OPS) -> None:
        super().__init__()
        self.layer_index = mtp_layer_index(target_hf)
        self.target = [target]  # a list: not a submodule (its weights are the target's)
        hf = dict(target_hf, num_hidden_layers=self.layer_index + 1)
        cfg = DecoderConfig.from_hf(hf)
        # The MTP layer alone: the last stage of an (L + 1)-stage split of an (L + 1)-layer
        # model has exactly that layer, the final norm (shared_head.norm) and the LM head
        # (shared_head.head), and no embedding.
        stage = replace(ctx, pp_rank=self.layer_index, pp_size=self.layer_index + 1,
                        pp_group=None)
        self.block = LlamaForCausalLM(cfg, stage, dtype, max_position, ops)
        hidden = cfg.hidden_size
        self.enorm = make_norm(cfg, hidden, dtype, ctx.device, ops)
        self.hnorm = make_norm(cfg, hidden, dtype, ctx.device, ops)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, False, ctx, dtype)
        # Set on a pipeline stage without the target's embedding (runner/spec_decode).
        self.embed_tokens: nn.Module | None = None

    @property
    def layer(self) -> LlamaDecoderLayer:
        return cast(LlamaDecoderLayer, self.block.model.layers[self.layer_index])

    @property
    def attention_layers(self) -> list[Attention]:
        return self.block.attention_layers

    def feature(self, hidden: torch.Tensor, aux: list[torch.Tensor], index: torch.Tensor
                ) -> torch.Tensor:
        return hidden.index_select(0, index)  # the target's last hidden state

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        embed = self.embed_tokens or self.target[0].model.embed_tokens
        embeds = embed(token_ids)
        embeds = embeds * (positions != 0).unsqueeze(-1).to(embeds.dtype)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(feature)), dim=-1))
        rope = cast(RotaryEmbedding, self.block.model.rotary_embs[self.layer.rope])
        hidden, residual = self.layer(rope.cos_sin(positions), x, None, meta)
        return hidden + residual

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = cast(nn.Module, self.block.model.norm)
        return self.block.compute_logits(norm(hidden)).argmax(dim=-1)

    def wants(self, name: str) -> bool:
        """The checkpoint tensors of the MTP layer (the rest of the file is the target's)."""
        return name.startswith(f"model.layers.{self.layer_index}.")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        prefix = f"model.layers.{self.layer_index}."
        own = dict(self.named_parameters())
        block_weights: list[tuple[str, Any]] = []
        seen: set[str] = set()
        for name, tensor in weights:
            short = name.removeprefix(prefix)
            if short.startswith("embed_tokens."):
                continue  # the target's embedding is shared
            if short in _FUSION:
                param = own[_FUSION[short]]
                getattr(param, "weight_loader", replicated_weight_loader)(param, tensor)
                seen.add(_FUSION[short])
            elif short in _SHARED_HEAD:
                block_weights.append((_SHARED_HEAD[short], tensor))
            else:
                block_weights.append((name, tensor))
        missing = sorted(set(_FUSION.values()) - seen)
        if missing:
            raise ValueError(f"MTP layer {self.layer_index}: tensors missing from the "
                             f"checkpoint: {missing}.")
        self.block.load_weights(block_weights)  # raises on anything missing or unknown
