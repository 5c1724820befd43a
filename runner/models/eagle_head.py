"""EAGLE draft heads: decoder layers that read the target's hidden states.

EAGLE-1 (``method="eagle"``): ``fc([embed(x_{p+1}); h_p])`` then the head's decoder layers
(the first without its input norm), whose output goes straight into the target's LM head
and, for the next draft, back in as the feature. EAGLE-3 (``"eagle3"``): the feature is
``fc`` over the inputs of three target layers (low, middle, high); one layer normalises the
embedding and the feature apart and attends over both side by side (q/k/v read 2H); its
output, normed, goes through the head's own LM head over a smaller draft vocabulary that
``d2t`` maps back to the target's. The checkpoint names are those of the public heads
(``fc.*``, ``layers.{i}.*`` or ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``; an
``embed_tokens`` is optional: the target's is shared otherwise). docs/architecture.md §24.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    read_whole,
    replicated_weight_loader,
)
from raylm.runner.attention.paged_attention import Attention, AttentionMetadata
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.fused_ops import EAGER_OPS, FusedOps
from raylm.runner.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    make_norm,
)
from raylm.runner.models.mla import ReplicatedLinear
from raylm.runner.rotary import RotaryEmbedding
from raylm.scheduler.config.speculative_config import eagle3_aux_layers

EAGLE_METHODS = ("eagle", "eagle3")
# (checkpoint name fragment, parameter name fragment, shard id), as the target's loader
_STACKED = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"),
            (".v_proj.", ".qkv_proj.", "v"), (".gate_proj.", ".gate_up_proj.", 0),
            (".up_proj.", ".gate_up_proj.", 1))
_IGNORED = ("t2d",)  # the target-to-draft mask: drafting needs only d2t


@dataclass(frozen=True)
class EagleHeadConfig:
    method: str
    decoder: DecoderConfig  # the head's layers
    target_hidden_size: int
    draft_vocab_size: int  # EAGLE-1: the target's vocabulary
    aux_layers: tuple[int, ...]  # EAGLE-3: the target layers whose inputs feed ``fc``
    fc_bias: bool
    has_embedding: bool

    @classmethod
    def from_hf(cls, method: str, head_hf: dict[str, Any], target_hf: dict[str, Any],
                tensor_names: Iterable[str]) -> EagleHeadConfig:
        if method not in EAGLE_METHODS:
            raise ValueError(f"speculative_config.method {method!r} is not an EAGLE method "
                             f"{list(EAGLE_METHODS)}.")
        names = {n.removeprefix("model.") for n in tensor_names}
        layer_hf = dict(head_hf, architectures=["LlamaForCausalLM"])
        decoder = DecoderConfig.from_hf(layer_hf)
        target_hidden = int(target_hf["hidden_size"])
        target_layers = int(target_hf["num_hidden_layers"])
        if method == "eagle":
            if decoder.hidden_size != target_hidden:
                raise ValueError(f"speculative_config.model: an EAGLE head's hidden_size "
                                 f"{decoder.hidden_size} must be the target's {target_hidden}.")
            if "fc.weight" not in names or "layers.0.self_attn.q_proj.weight" not in names:
                raise ValueError("speculative_config.model: not an EAGLE-1 head (it needs "
                                 "fc.weight and layers.0.*; an EAGLE-3 head is method "
                                 "'eagle3').")
            aux: tuple[int, ...] = ()
            draft_vocab = int(target_hf["vocab_size"])
        else:
            if "midlayer.self_attn.q_proj.weight" not in names:
                raise ValueError("speculative_config.model: not an EAGLE-3 head (it needs "
                                 "midlayer.*; an EAGLE-1 head is method 'eagle').")
            if decoder.num_hidden_layers != 1:
                raise ValueError(f"speculative_config.model: an EAGLE-3 head has one layer, "
                                 f"its config says num_hidden_layers="
                                 f"{decoder.num_hidden_layers}.")
            aux = eagle3_aux_layers(head_hf, target_layers)
            draft_vocab = int(head_hf.get("draft_vocab_size") or head_hf["vocab_size"])
        if decoder.vocab_size != int(target_hf["vocab_size"]):
            raise ValueError(f"speculative_config.model: vocab_size {decoder.vocab_size} is "
                             f"not the target's {target_hf['vocab_size']}.")
        return cls(method, decoder, target_hidden, draft_vocab, aux, "fc.bias" in names,
                   "embed_tokens.weight" in names)


class _NoInputNorm(nn.Module):
    """EAGLE-1's first layer has no input norm: its input is fc's output as it is."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return x if residual is None else (x + residual, x + residual)


class Eagle3Layer(nn.Module):
    """EAGLE-3's one layer: the embedding and the feature normalised apart, side by side
    into attention (q/k/v read 2H), the feature as the residual."""

    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: FusedOps) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.input_layernorm = make_norm(cfg, hidden, dtype, ctx.device, ops)
        self.hidden_norm = make_norm(cfg, hidden, dtype, ctx.device, ops)
        self.self_attn = LlamaAttention(replace(cfg, hidden_size=2 * hidden), ctx, dtype, ops)
        # Its output returns to the residual's width.
        self.self_attn.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim,
                                                  hidden, cfg.o_bias, ctx=ctx,
                                                  params_dtype=dtype)
        self.post_attention_layernorm = make_norm(cfg, hidden, dtype, ctx.device, ops)
        self.mlp = LlamaMLP(cfg, ctx, dtype)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], embeds: torch.Tensor,
                feature: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(feature)), dim=-1)
        attn = self.self_attn(cos_sin, x, meta)
        x, residual = self.post_attention_layernorm(attn, feature)
        return self.mlp(x) + residual


class EagleHead(nn.Module):
    d2t: torch.Tensor  # EAGLE-3's buffer (register_buffer), declared for the type checker

    def __init__(self, cfg: EagleHeadConfig, target: LlamaForCausalLM, ctx: ParallelContext,
                 dtype: torch.dtype, max_position: int, ops: FusedOps = EAGER_OPS) -> None:
        super().__init__()
        self.cfg = cfg
        self.target = [target]  # a list: not a submodule (its weights are the target's)
        d = cfg.decoder
        # The head's own, or (a pipeline stage without the target's) a copy of the
        # target's set by runner/spec_decode/eagle_proposer.py.
        self.embed_tokens: VocabParallelEmbedding | None = None
        if cfg.has_embedding:
            self.embed_tokens = VocabParallelEmbedding(d.vocab_size, d.hidden_size, ctx=ctx,
                                                       params_dtype=dtype)
        fc_in = 2 * d.hidden_size if cfg.method == "eagle" else 3 * cfg.target_hidden_size
        self.fc = ReplicatedLinear(fc_in, d.hidden_size, cfg.fc_bias, ctx, dtype)
        self.rotary_emb = RotaryEmbedding(d.rope_config, d.head_dim, max_position, dtype,
                                          ctx.device)
        self.layers = nn.ModuleList()
        self.midlayer: Eagle3Layer | None = None
        self.norm: nn.Module | None = None
        self.lm_head: ParallelLMHead | None = None
        if cfg.method == "eagle":
            self.layers.extend(LlamaDecoderLayer(d, ctx, dtype, ops, i)
                               for i in range(d.num_hidden_layers))
            self.layers[0].input_layernorm = _NoInputNorm()
        else:
            self.midlayer = Eagle3Layer(d, ctx, dtype, ops)
            self.norm = make_norm(d, d.hidden_size, dtype, ctx.device, ops)
            self.lm_head = ParallelLMHead(cfg.draft_vocab_size, d.hidden_size, ctx=ctx,
                                          params_dtype=dtype)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64,
                                                    device=ctx.device))

    @property
    def attention_layers(self) -> list[Attention]:
        if self.midlayer is not None:
            return [self.midlayer.self_attn.attn]
        layers = [cast(LlamaDecoderLayer, layer) for layer in self.layers]
        return [cast(LlamaAttention, layer.self_attn).attn for layer in layers]

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        embed = self.embed_tokens or self.target[0].model.embed_tokens
        return embed(token_ids)

    def feature(self, hidden: torch.Tensor, aux: list[torch.Tensor], index: torch.Tensor
                ) -> torch.Tensor:
        """The target's feature at the rows ``index`` of its step: its last hidden state
        (EAGLE-1), or ``fc`` over the three layers' inputs (EAGLE-3)."""
        if self.cfg.method == "eagle":
            return hidden.index_select(0, index)
        return self.fc(torch.cat([a.index_select(0, index) for a in aux], dim=-1))

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The head at each position: ``token_ids[i]`` is the token after the one whose
        feature is ``feature[i]``. Returns the next feature (pre-norm)."""
        cos_sin = self.rotary_emb.cos_sin(positions)
        embeds = self._embed(token_ids)
        if self.midlayer is not None:
            return self.midlayer(cos_sin, embeds, feature, meta)
        hidden, residual = self.fc(torch.cat((embeds, feature), dim=-1)), None
        for layer in self.layers:
            hidden, residual = layer(cos_sin, hidden, residual, meta)
        return hidden + residual

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy drafts, target token ids."""
        if self.lm_head is None:
            return self.target[0].compute_logits(hidden).argmax(dim=-1)
        assert self.norm is not None  # EAGLE-3 has both
        draft = self.lm_head.compute_logits(self.norm(hidden)).argmax(dim=-1)
        return draft + self.d2t.index_select(0, draft)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if name in _IGNORED or (name == "lm_head.weight" and self.lm_head is None):
                continue  # EAGLE-1 uses the target's LM head
            if name == "d2t":
                self.d2t.copy_(read_whole(tensor))
                continue
            for ckpt_part, param_part, shard in _STACKED:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, param_part)
                    if target not in params:
                        break
                    param = params[target]
                    param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
                    break
            else:
                target = name
                if target not in params:
                    raise ValueError(f"EAGLE head tensor {raw!r} matches no parameter of a "
                                     f"{self.cfg.method} head.")
                param = params[target]
                getattr(param, "weight_loader", replicated_weight_loader)(param, tensor)
            if target not in params:
                raise ValueError(f"EAGLE head tensor {raw!r} matches no parameter of a "
                                 f"{self.cfg.method} head.")
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"EAGLE head parameters missing from the checkpoint: {missing}.")
