"""A checkpoint's own multi-token-prediction layer as a draft head (``method="mtp"``):
DeepSeek-V3's and Qwen3-Next's.

Both fuse the embedding of token p + 1 with the target's last hidden state h_p (after its
final norm), each normalised apart, through one linear, then run one decoder layer of the
target's kind (DeepSeek: latent attention and experts; Qwen3-Next: gated full attention and
experts) whose output gives the draft and goes back in as the feature of the next one (one
layer chained k times). They differ in names and in where the norm sits
(``MTPLayout``): DeepSeek's layer L = ``num_hidden_layers`` has ``enorm``/``hnorm``/
``eh_proj`` and ``shared_head.{norm,head}`` (its output feeds back before that norm, and
the embedding is zeroed at position 0, as DeepSeek's inference does); Qwen3-Next's ``mtp.``
tensors have ``pre_fc_norm_embedding``/``pre_fc_norm_hidden``/``fc`` and ``norm``, whose
output both feeds back and meets the target's LM head. The layer is built and loaded by
the target's own model class as the last stage of an (L + 1)-layer split, so every layer
kind the target supports loads the same way. The embedding is the target's. Same interface
as EagleHead (runner/models/eagle_head.py); docs/architecture.md §24.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import PPMissingLayer, replicated_weight_loader
from raylm.runner.attention.paged_attention import Attention, AttentionMetadata
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.fused_ops import EAGER_OPS, FusedOps
from raylm.runner.models.llama import LlamaDecoderLayer, LlamaForCausalLM, make_norm
from raylm.runner.models.mla import ReplicatedLinear
from raylm.runner.rotary import RotaryEmbedding


@dataclass(frozen=True)
class MTPLayout:
    prefix: str  # the MTP layer's tensors (``{L}``: the layer index)
    layer_prefix: str  # its decoder layer's, within ``prefix``
    fusion: dict[str, str]  # its fusion tensors -> this module's parameters
    final: dict[str, str]  # its final norm (and LM head) -> the block's parameters
    masks_position_zero: bool
    feeds_back_normed: bool  # the next feature is after the final norm
    own_lm_head: bool


MTP_LAYOUTS = {
    "DeepseekV3ForCausalLM": MTPLayout(
        "model.layers.{L}.", "",
        {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
         "eh_proj.weight": "eh_proj.weight"},
        {"shared_head.norm.weight": "model.norm.weight",
         "shared_head.head.weight": "lm_head.weight"},
        masks_position_zero=True, feeds_back_normed=False, own_lm_head=True),
    "Qwen3NextForCausalLM": MTPLayout(
        "mtp.", "layers.0.",
        {"pre_fc_norm_embedding.weight": "enorm.weight",
         "pre_fc_norm_hidden.weight": "hnorm.weight", "fc.weight": "eh_proj.weight"},
        {"norm.weight": "model.norm.weight"},
        masks_position_zero=False, feeds_back_normed=True, own_lm_head=False),
}


def mtp_layout(target_hf: dict[str, Any], tensor_names: Iterable[str]) -> MTPLayout:
    """The target's MTP layout; ValueError when it has no MTP layer."""
    arch = next(iter(target_hf.get("architectures") or []), "")
    if arch not in MTP_LAYOUTS:
        raise ValueError(f"speculative_config.method 'mtp' needs a model with MTP layers "
                         f"{list(MTP_LAYOUTS)}; this one is {arch!r}.")
    layout = MTP_LAYOUTS[arch]
    first = layout.prefix.format(L=target_hf["num_hidden_layers"]) + layout.layer_prefix
    if not any(n.startswith(first) for n in tensor_names):
        raise ValueError(f"speculative_config.method 'mtp': the checkpoint has no MTP layer "
                         f"(no {first}* tensors).")
    return layout


class MTPHead(nn.Module):
    def __init__(self, target_hf: dict[str, Any], layout: MTPLayout, target: LlamaForCausalLM,
                 ctx: ParallelContext, dtype: torch.dtype, max_position: int,
                 ops: FusedOps = EAGER_OPS) -> None:
        super().__init__()
        self.layout = layout
        self.layer_index = int(target_hf["num_hidden_layers"])
        self.prefix = layout.prefix.format(L=self.layer_index)
        self.target = [target]  # a list: not a submodule (its weights are the target's)
        hf = dict(target_hf, num_hidden_layers=self.layer_index + 1)
        if hf.get("layer_types"):  # Qwen3-Next: the MTP layer is full attention
            hf["layer_types"] = [*hf["layer_types"][:self.layer_index], "full_attention"]
        cfg = DecoderConfig.from_hf(hf)
        # The MTP layer alone: the last stage of an (L + 1)-stage split of an (L + 1)-layer
        # model has exactly that layer and the final norm (and an LM head), no embedding.
        stage = replace(ctx, pp_rank=self.layer_index, pp_size=self.layer_index + 1,
                        pp_group=None)
        self.block = LlamaForCausalLM(cfg, stage, dtype, max_position, ops)
        if not layout.own_lm_head:
            self.block.lm_head = PPMissingLayer()  # the target's serves
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

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return cast(nn.Module, self.block.model.norm)(hidden)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        embed = self.embed_tokens or self.target[0].model.embed_tokens
        embeds = embed(token_ids)
        if self.layout.masks_position_zero:
            embeds = embeds * (positions != 0).unsqueeze(-1).to(embeds.dtype)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(feature)), dim=-1))
        rope = cast(RotaryEmbedding, self.block.model.rotary_embs[self.layer.rope])
        hidden, residual = self.layer(rope.cos_sin(positions), x, None, meta)
        out = hidden + residual
        return self._final_norm(out) if self.layout.feeds_back_normed else out

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.layout.feeds_back_normed:
            return self.target[0].compute_logits(hidden).argmax(dim=-1)
        return self.block.compute_logits(self._final_norm(hidden)).argmax(dim=-1)

    def wants(self, name: str) -> bool:
        """The checkpoint tensors of the MTP layer (the rest of the file is the target's)."""
        return name.startswith(self.prefix)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        layout, own = self.layout, dict(self.named_parameters())
        layer_prefix = self.prefix + layout.layer_prefix
        block_weights: list[tuple[str, Any]] = []
        seen: set[str] = set()
        for name, tensor in weights:
            short = name.removeprefix(self.prefix)
            if short.startswith("embed_tokens."):
                continue  # the target's embedding is shared
            if short in layout.fusion:
                param = own[layout.fusion[short]]
                getattr(param, "weight_loader", replicated_weight_loader)(param, tensor)
                seen.add(layout.fusion[short])
            elif short in layout.final:
                block_weights.append((layout.final[short], tensor))
            elif name.startswith(layer_prefix):
                rest = name.removeprefix(layer_prefix)
                block_weights.append((f"model.layers.{self.layer_index}.{rest}", tensor))
            else:
                raise ValueError(f"MTP tensor {name!r} matches no part of the MTP layer.")
        missing = sorted(set(layout.fusion.values()) - seen)
        if missing:
            raise ValueError(f"MTP layer {self.layer_index}: tensors missing from the "
                             f"checkpoint: {missing}.")
        self.block.load_weights(block_weights)  # raises on anything missing or unknown
