"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Gemma 2 and 3, the mixtures of experts
Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 with its latent attention, and the
hybrids Bamba, Granite 4, Qwen3-Next, Falcon-H1) over one flattened mixed batch.

``forward(input_ids [T], positions [T], attn_metadata)`` runs every scheduled token of every
request at once (prefills, chunks and decodes together). With pipeline parallelism the
model holds only its stage's layers: the first stage owns the embedding, the last the final
norm and LM head; a non-last stage returns ``IntermediateTensors`` (hidden states and the
residual, both [T, hidden]) that the next stage passes back in as ``intermediate_tensors``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    PPMissingLayer,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    Weight,
    get_pp_layer_range,
    read_whole,
    replicated_weight_loader,
)
from raylm.runner.attention.paged_attention import Attention, AttentionMetadata
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.fused_decode_layer import FusedDecodeLayers, PlainLayer
from raylm.runner.models.fused_ops import EAGER_OPS, FusedOps
from raylm.runner.models.gated_delta_mixer import GatedDeltaNetMixer
from raylm.runner.models.mamba2_mixer import Mamba2Mixer
from raylm.runner.models.mla import MLAAttention
from raylm.runner.models.moe import SparseMoeBlock
from raylm.runner.models.projection_norm import ProjectionRMSNorm
from raylm.runner.models.recurrent_mixer import RecurrentMixer
from raylm.runner.rotary import RotaryEmbedding


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands to the next."""

    hidden_states: torch.Tensor
    residual: torch.Tensor
    # An EAGLE-3 head's feature layers at or before this point (their inputs, in layer
    # order, one per distinct layer): the last stage's head reads them all.
    aux: tuple[torch.Tensor, ...] = ()


def aux_layers_before(aux_layers: tuple[int, ...], layer: int) -> list[int]:
    """The distinct feature layers an EAGLE-3 head reads that lie before ``layer``, in the
    order a stage receives their inputs (``IntermediateTensors.aux``)."""
    return sorted({i for i in aux_layers if i < layer})


class _LoaderParam(Protocol):
    """A parameter its parallel layer gave a ``weight_loader`` (parallel/layers.py sets it
    on the nn.Parameter, which torch does not declare)."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: Weight,
                      shard_id: object = None) -> None: ...


def _attached_loader(param: nn.Parameter) -> _LoaderParam:
    return cast(_LoaderParam, param)  # the attribute is set at run time


class RMSNorm(nn.Module):
    """HF's RMSNorm (fused_ops.py), with the residual add fused in front as in vLLM:
    ``forward(x, residual)`` returns (norm(x + residual), x + residual)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 ops: FusedOps = EAGER_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: computed in float32 and scaled by ``1 + weight`` before the cast
    back (transformers' Gemma3RMSNorm); the residual add fused in front as ``RMSNorm``."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).type_as(x)
        return out if residual is None else (out, x)


Norm = RMSNorm | GemmaRMSNorm


def make_norm(cfg: DecoderConfig, size: int, dtype: torch.dtype, device: torch.device,
              ops: FusedOps = EAGER_OPS) -> Norm:
    if cfg.offset_norms:  # Gemma, Qwen3-Next
        return GemmaRMSNorm(size, cfg.rms_norm_eps, dtype, device)
    return RMSNorm(size, cfg.rms_norm_eps, dtype, device, ops)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size],
                                                       cfg.mlp_bias, ctx=ctx, params_dtype=dtype)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, cfg.mlp_bias, ctx=ctx,
                                           params_dtype=dtype)
        self.gelu_tanh = cfg.gemma is not None  # Gemma's gelu_pytorch_tanh, else SiLU
        # Falcon-H1's muP: the gate scaled before the activation, the output after
        self.multipliers = ((cfg.falcon.mlp_gate_multiplier, cfg.falcon.mlp_down_multiplier)
                            if cfg.falcon is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        if self.multipliers is not None:
            gate = gate * self.multipliers[0]
        act = F.gelu(gate, approximate="tanh") if self.gelu_tanh else F.silu(gate)
        out = self.down_proj(act * up)
        return out if self.multipliers is None else out * self.multipliers[1]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: FusedOps = EAGER_OPS, sliding_window: int | None = None) -> None:
        super().__init__()
        self.ops = ops
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.qkv_bias, ctx=ctx,
                                          params_dtype=dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size,
                                        cfg.o_bias, ctx=ctx, params_dtype=dtype)
        # Qwen3-Next: the output gated per channel by sigmoid of a projection that its
        # checkpoint's q_proj carries beside each head's query.
        self.attn_gate: ColumnParallelLinear | None = None
        if cfg.attn_output_gate:
            self.attn_gate = ColumnParallelLinear(cfg.hidden_size, cfg.num_attention_heads * d,
                                                  cfg.qkv_bias, ctx=ctx, params_dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm: Norm | ProjectionRMSNorm | None = None
        self.k_norm: Norm | ProjectionRMSNorm | None = None
        self.norm_projection = cfg.qk_norm == "projection"
        if cfg.qk_norm == "head":
            self.q_norm = make_norm(cfg, d, dtype, ctx.device, ops)
            self.k_norm = make_norm(cfg, d, dtype, ctx.device, ops)
        elif self.norm_projection:
            kv_shard = ctx.tp_rank // self.qkv_proj.num_kv_head_replicas
            self.q_norm = ProjectionRMSNorm(self.q_size, ctx.tp_rank, cfg.rms_norm_eps, ctx,
                                            dtype)
            self.k_norm = ProjectionRMSNorm(self.kv_size, kv_shard, cfg.rms_norm_eps, ctx,
                                            dtype)
        scale = (cfg.gemma.attn_scale if cfg.gemma is not None
                 else cfg.granite.attention_multiplier if cfg.granite is not None
                 else d ** -0.5)
        # Granite 4 without position embeddings ("nope"): no rotation at all.
        self.use_rope = cfg.granite is None or cfg.granite.use_rope
        self.key_multiplier = cfg.falcon.key_multiplier if cfg.falcon is not None else 1.0
        self.attn = Attention(self.num_heads, d, self.num_kv_heads, scale=scale,
                              sliding_window=sliding_window,
                              softcap=cfg.gemma.attn_logit_softcapping if cfg.gemma else None)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norm_projection:  # OLMoE: over the whole projection, before the heads
            assert self.q_norm is not None and self.k_norm is not None  # set together
            q, k = self.q_norm(q), self.k_norm(k)
        num_tokens = hidden_states.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.key_multiplier != 1.0:  # Falcon-H1
            k = k * self.key_multiplier
        if self.use_rope:
            q, k = self.ops.rotary(*cos_sin, q, k)
        out = self.attn(q, k, v, meta)
        if self.attn_gate is not None:
            out = out * torch.sigmoid(self.attn_gate(hidden_states))
        return self.o_proj(out)

    def load_gated_q_proj(self, tensor: Weight) -> None:
        """Qwen3-Next's q_proj (weight or bias): per head its query then its gate."""
        assert self.attn_gate is not None  # only for attention with an output gate
        whole = read_whole(tensor)
        heads = whole.reshape(-1, 2, self.head_dim, *whole.shape[1:])
        query, gate = (heads[:, i].reshape(-1, *whole.shape[1:]) for i in (0, 1))
        bias = whole.dim() == 1
        for linear, part, shard in ((self.qkv_proj, query, "q"), (self.attn_gate, gate, None)):
            target = linear.bias if bias else linear.weight
            assert target is not None  # a q_proj bias comes with qkv_bias
            linear.weight_loader(target, part, shard)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext, dtype: torch.dtype,
                 ops: FusedOps = EAGER_OPS, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, dtype, ctx.device, ops)
        # The token mixer: attention, or a Mamba2 mixer in a hybrid model's state layers.
        self.self_attn: LlamaAttention | MLAAttention | None = None
        self.mamba: Mamba2Mixer | None = None  # Bamba, Granite 4
        self.linear_attn: GatedDeltaNetMixer | None = None  # Qwen3-Next
        mixer = cfg.layer_mixers[layer] if cfg.layer_mixers else "attention"
        if mixer in ("mamba2", "parallel"):
            assert cfg.mamba is not None  # set with the mixers (DecoderConfig.from_hf)
            self.mamba = Mamba2Mixer(cfg.mamba, cfg.hidden_size, ctx, dtype)
        if mixer == "parallel":  # Falcon-H1: attention beside the Mamba2 mixer
            self.self_attn = LlamaAttention(cfg, ctx, dtype, ops, cfg.layer_windows[layer])
        elif mixer == "gated_delta":
            assert cfg.gated_delta is not None  # set with the mixers
            self.linear_attn = GatedDeltaNetMixer(cfg.gated_delta, cfg.hidden_size, ctx, dtype)
        elif mixer == "attention" and cfg.mla is not None:  # DeepSeek-V3
            self.self_attn = MLAAttention(cfg.mla, cfg.hidden_size, cfg.num_attention_heads,
                                          cfg.qkv_bias, cfg.rms_norm_eps, ctx, dtype)
        elif mixer == "attention":
            self.self_attn = LlamaAttention(cfg, ctx, dtype, ops, cfg.layer_windows[layer])
        if self.self_attn is not None:
            self.self_attn.attn.decoder_layer = layer
        self.falcon = cfg.falcon
        # Llama: the norm before the MLP. Gemma: the norm of the attention's output, with
        # pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it.
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, dtype, ctx.device, ops)
        self.pre_feedforward_layernorm: Norm | None = None
        self.post_feedforward_layernorm: Norm | None = None
        if cfg.gemma is not None:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype, ctx.device)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype, ctx.device)
        self.rope = cfg.gemma.layer_rope[layer] if cfg.gemma is not None else 0
        # Granite 4 scales the mixer's and the MLP's outputs before each residual add.
        self.residual_multiplier = (cfg.granite.residual_multiplier
                                    if cfg.granite is not None else None)
        self.mlp: LlamaMLP | SparseMoeBlock = LlamaMLP(cfg, ctx, dtype)
        if cfg.moe_layers[layer]:
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.norm_topk_prob, ctx, dtype,
                                      cfg.shared_expert_intermediate_size,
                                      cfg.shared_expert_gated, cfg.grouped_sigmoid)

    def plain_layer(self) -> PlainLayer | None:
        """This layer's parts for the fused decode call (fused_decode_layer.py), or None
        where it is not a plain Llama layer: RMSNorm, full rotary, SiLU MLP, no q/k norm,
        no output gate, no window or soft cap, no muP or residual multipliers."""
        attn, mlp = self.self_attn, self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if (not isinstance(attn, LlamaAttention) or not isinstance(mlp, LlamaMLP)
                or self.recurrent_mixer is not None or self.falcon is not None
                or self.residual_multiplier is not None
                or self.pre_feedforward_layernorm is not None
                or not all(isinstance(n, RMSNorm) for n in norms)
                or norms[0].eps != norms[1].eps):
            return None
        if (attn.q_norm is not None or attn.attn_gate is not None or not attn.use_rope
                or attn.key_multiplier != 1.0 or attn.attn.sliding_window is not None
                or attn.attn.softcap or attn.attn.latent_cache or attn.attn.kv_group
                or mlp.gelu_tanh or mlp.multipliers is not None):
            return None
        return PlainLayer(attn.attn, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                      mlp.down_proj),
                          norms[0].weight, norms[1].weight, norms[0].eps)

    @property
    def recurrent_mixer(self) -> RecurrentMixer | None:
        return self.mamba if self.mamba is not None else self.linear_attn

    def _mix(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
             meta: AttentionMetadata) -> torch.Tensor:
        """The layer's token mixing: attention, a recurrent mixer, or (Falcon-H1) both
        on the same input, scaled and summed."""
        recurrent = self.recurrent_mixer
        mixed = None
        if recurrent is not None:
            if meta.state is None:
                raise RuntimeError("a recurrent layer ran without the step's state metadata.")
            mixed = recurrent(x, meta.state)
        if self.self_attn is None:
            assert mixed is not None  # every layer has a mixer
            return mixed
        if self.falcon is None:
            return self.self_attn(cos_sin, x, meta)
        assert mixed is not None  # Falcon-H1's layers have both
        attn = self.self_attn(cos_sin, x * self.falcon.attention_in_multiplier, meta)
        return (mixed * self.falcon.ssm_out_multiplier
                + attn * self.falcon.attention_out_multiplier)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self._mix(cos_sin, hidden_states, meta)
        if self.residual_multiplier is not None:
            hidden_states, residual = self.post_attention_layernorm(
                hidden_states * self.residual_multiplier, residual)
            return self.mlp(hidden_states) * self.residual_multiplier, residual
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return self.mlp(hidden_states), residual
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext, dtype: torch.dtype,
                 max_position: int, ops: FusedOps = EAGER_OPS) -> None:
        super().__init__()
        self.ctx = ctx
        self.start_layer, self.end_layer = get_pp_layer_range(
            cfg.num_hidden_layers, ctx.pp_rank, ctx.pp_size)
        self.embed_tokens: VocabParallelEmbedding | PPMissingLayer = PPMissingLayer()
        if ctx.is_first_pp_rank:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx=ctx,
                                                       params_dtype=dtype)
        # One RoPE table per kind of layer (Gemma 3: the global layers', the sliding ones').
        rope_configs = cfg.gemma.rope_params if cfg.gemma is not None else (cfg.rope_config,)
        self.rotary_embs = nn.ModuleList(
            RotaryEmbedding(hf, cfg.head_dim, max_position, dtype, ctx.device)
            for hf in rope_configs)
        # Gemma scales the embedding by sqrt(hidden), cast to the weights' dtype as HF does.
        self.embed_scale = (torch.tensor(cfg.gemma.embed_scale).to(dtype).item()
                            if cfg.gemma is not None
                            else cfg.granite.embedding_multiplier if cfg.granite is not None
                            else cfg.falcon.embedding_multiplier if cfg.falcon is not None
                            else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, ctx, dtype, ops, i)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(cfg.num_hidden_layers))
        self.norm: Norm | PPMissingLayer = PPMissingLayer()
        if ctx.is_last_pp_rank:
            self.norm = make_norm(cfg, cfg.hidden_size, dtype, ctx.device, ops)
        # An EAGLE-3 head reads these layers' inputs (the residual stream there) from the
        # last forward (runner/spec_decode/eagle_proposer.py); empty: none are kept.
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []
        # Decode steps of a quantized Llama on the CPU: a C++ call per layer; built at the
        # first forward, once the weights are packed and LoRA hooks are on.
        self.fused_decode: FusedDecodeLayers | None = None
        self._fused_decode_built = False

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None):
        aux = self.aux_hidden_layers
        kept: dict[int, torch.Tensor] = {}
        if self.ctx.is_first_pp_rank:
            hidden_states, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                hidden_states = hidden_states * self.embed_scale
        else:
            if intermediate_tensors is None:
                raise ValueError("a non-first pipeline stage needs intermediate_tensors.")
            hidden_states = intermediate_tensors.hidden_states
            residual = intermediate_tensors.residual
            kept = dict(zip(aux_layers_before(aux, self.start_layer), intermediate_tensors.aux,
                            strict=True))
        cos_sins = [cast(RotaryEmbedding, r).cos_sin(positions) for r in self.rotary_embs]
        if not self._fused_decode_built:
            self.fused_decode = self.fused_decode_layers()
            self._fused_decode_built = True
        fused = self.fused_decode
        if fused is not None and not aux and fused.applies(attn_metadata, hidden_states):
            hidden_states, residual = fused.forward(cos_sins[0], hidden_states, residual,
                                                    attn_metadata)
            return self._finish_stage(hidden_states, residual, kept)
        for index, layer in enumerate(self.layers[self.start_layer:self.end_layer],
                                      self.start_layer):
            if index in aux:
                kept[index] = hidden_states if residual is None else hidden_states + residual
            hidden_states, residual = layer(cos_sins[cast(LlamaDecoderLayer, layer).rope],
                                            hidden_states, residual, attn_metadata)
        return self._finish_stage(hidden_states, residual, kept)

    def fused_decode_layers(self) -> FusedDecodeLayers | None:
        """This stage's layers as one C++ call each for decode steps (docs/architecture.md
        §6), where every layer is plain and no EAGLE-3 head reads its features."""
        if self.aux_hidden_layers or len(self.rotary_embs) != 1 or self.ctx.tp_size != 1:
            return None
        layers = [cast(LlamaDecoderLayer, layer).plain_layer()
                  for layer in self.layers[self.start_layer:self.end_layer]]
        rotary = cast(RotaryEmbedding, self.rotary_embs[0])
        return FusedDecodeLayers.build(layers, self.ctx.device, rotary.cos_cache.shape[-1])

    def _finish_stage(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                      kept: dict[int, torch.Tensor]):
        """The stage's output after its layers: what the next stage takes, or the final
        norm's hidden states."""
        aux = self.aux_hidden_layers
        if not self.ctx.is_last_pp_rank:
            assert residual is not None  # every stage has a layer (get_pp_layer_range)
            return IntermediateTensors(hidden_states, residual,
                                       tuple(kept[i] for i in sorted(kept)))
        if aux:
            self.aux_hidden_states = [kept[i] for i in aux]
        if residual is None:  # a last stage without layers (not a useful split, but valid)
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# model.layers.{layer}.mlp.experts.{expert}.{gate,up,down}_proj.weight (Qwen-MoE, OLMoE)
_EXPERT_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
                            r"(gate_proj|up_proj|down_proj)\.weight")
# Mixtral's names for the same: block_sparse_moe.{gate, experts.{e}.w1 (gate), w3 (up),
# w2 (down)}
_MIXTRAL_WEIGHT = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|"
                             r"experts\.\d+\.)(?:(w1)|(w2)|(w3))?(\.weight)?")
_MIXTRAL_PROJ = ("gate_proj", "down_proj", "up_proj")


# Bamba's names for Llama's parts, and the recurrent mixers' tensors that are parameters
# here under another name (Mamba2's fused in_proj is loaded by the mixer itself).
_RECURRENT_RENAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                  ("model.final_layernorm.", "model.norm."),
                  (".mamba.conv1d.weight", ".mamba.conv_weight"),
                  (".mamba.conv1d.bias", ".mamba.conv_bias"),
                  (".mamba.norm.weight", ".mamba.norm_weight"),
                  (".linear_attn.conv1d.weight", ".linear_attn.conv_weight"),
                  (".linear_attn.norm.weight", ".linear_attn.norm_weight"))
_MAMBA_IN_PROJ = re.compile(r"model\.layers\.(\d+)\.mamba\.in_proj\.weight")
# Qwen3-Next: each head's query and output gate in one projection
_Q_PROJ = re.compile(r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)")
# Checkpoint tensors no parameter here reads: Qwen3-Next's multi-token-prediction layer
_NOT_LOADED = ("mtp.",)
# Granite 4's fused tensors: the shared MLP's [gate; up] and down, the experts' router and
# their [E, gate; up, hidden] and [E, hidden, intermediate] stacks.
_GRANITE_FUSED = re.compile(r"model\.layers\.(\d+)\.(shared_mlp|block_sparse_moe)\."
                            r"(input_linear|output_linear|router\.layer)\.weight")


def canonical_weight_name(name: str) -> str:
    """The checkpoint tensor's name in the spelling the loader matches (Qwen-MoE's for
    experts, Llama's for Bamba's layers, Qwen2-MoE's for DeepSeek's shared experts)."""
    if ".mlp.shared_experts." in name:
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    for old, new in _RECURRENT_RENAMES:
        if old in name:
            return name.replace(old, new)
    match = _MIXTRAL_WEIGHT.fullmatch(name)
    if match is None:
        return name
    projection = next((_MIXTRAL_PROJ[i] for i in range(3) if match[3 + i]), "")
    return f"{match[1]}mlp.{match[2]}{projection}{match[6] or ''}"
# (checkpoint name fragment, parameter name fragment, shard id)
_STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext, dtype: torch.dtype,
                 max_position: int | None = None, ops: FusedOps = EAGER_OPS) -> None:
        super().__init__()
        self.config = cfg
        self.ctx = ctx
        self.model = LlamaModel(cfg, ctx, dtype, max_position or cfg.max_position_embeddings,
                                ops)
        self.lm_head: ParallelLMHead | PPMissingLayer = PPMissingLayer()
        if ctx.is_last_pp_rank:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx=ctx,
                                          params_dtype=dtype)
            if cfg.tie_word_embeddings and ctx.is_first_pp_rank:
                embed = self.model.embed_tokens
                assert isinstance(embed, VocabParallelEmbedding)  # the first stage has it
                self.lm_head.weight = embed.weight

    def _stage_layers(self) -> list[LlamaDecoderLayer]:
        # The stage's own layers are all decoder layers (ModuleList items are untyped).
        return [cast(LlamaDecoderLayer, layer)
                for layer in self.model.layers[self.model.start_layer:self.model.end_layer]]

    @property
    def attention_layers(self) -> list[Attention]:
        """This stage's attention modules, in layer order (the KV cache binds to them)."""
        return [layer.self_attn.attn for layer in self._stage_layers()
                if layer.self_attn is not None]

    @property
    def state_layers(self) -> list[RecurrentMixer]:
        """This stage's recurrent mixers, in layer order (the state slots bind to them)."""
        return [m for m in (layer.recurrent_mixer for layer in self._stage_layers())
                if m is not None]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None):
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors)

    def dummy_expert_pass(self) -> None:
        """A DP rank without a forward this wave step: every sparse layer joins its
        expert-parallel collectives with no rows, in layer order (docs/architecture.md §19)."""
        for layer in self.model.layers[self.model.start_layer:self.model.end_layer]:
            mlp = cast(LlamaDecoderLayer, layer).mlp
            if isinstance(mlp, SparseMoeBlock):
                mlp.dummy_pass()

    def expert_load(self) -> dict[int, dict[int, int]]:
        """Per sparse layer of this stage: tokens routed to each of this rank's experts."""
        layers = self.model.layers[self.model.start_layer:self.model.end_layer]
        return {self.model.start_layer + i: mlp.expert_load()
                for i, mlp in enumerate(cast(LlamaDecoderLayer, layer).mlp for layer in layers)
                if isinstance(mlp, SparseMoeBlock)}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocab float32 logits on every TP rank of the last stage."""
        head = self.lm_head
        if not isinstance(head, ParallelLMHead):
            raise RuntimeError("only the last pipeline stage has the LM head to compute logits.")
        logits = head.compute_logits(hidden_states).float()
        cap = self.config.gemma.final_logit_softcapping if self.config.gemma else None
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.config.granite is not None:
            logits = logits / self.config.granite.logits_scaling
        if self.config.falcon is not None:
            logits = logits * self.config.falcon.lm_head_multiplier
        return logits

    def needs_weight(self, name: str) -> bool:
        """Whether this rank loads the checkpoint tensor ``name`` (its stage's layers, the
        embedding on the first stage, norm and head on the last), so loaders that read lazily
        skip the rest without reading them. ``load_weights`` applies the same rules."""
        ctx, tied = self.ctx, self.config.tie_word_embeddings
        if name.startswith(_NOT_LOADED):
            return False
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            # (DeepSeek's multi-token-prediction layers come after the decoder's)
            if not self.model.start_layer <= layer < self.model.end_layer:
                return False
            # Expert parallelism: another rank's expert stays unread.
            expert = _EXPERT_WEIGHT.fullmatch(canonical_weight_name(name))
            mlp = cast(LlamaDecoderLayer, self.model.layers[layer]).mlp
            return (expert is None or not isinstance(mlp, SparseMoeBlock)
                    or mlp.holds_expert(int(expert[2])))
        if name.startswith("model.embed_tokens."):
            return ctx.is_first_pp_rank or (tied and ctx.is_last_pp_rank)
        if name.startswith("lm_head."):
            return ctx.is_last_pp_rank and not tied
        if name.startswith("model.norm."):
            return ctx.is_last_pp_rank
        return "rotary_emb.inv_freq" not in name

    def _load_granite_fused(self, layer: int, block: str, part: str, tensor: Weight
                            ) -> list[str]:
        """One of Granite 4's fused MLP tensors into its parameters; returns the names of
        the parameters it completed."""
        mlp = cast(LlamaDecoderLayer, self.model.layers[layer]).mlp
        prefix = f"model.layers.{layer}.mlp."
        if block == "shared_mlp":
            # Dense (no experts): the layer's MLP; else the sparse block's shared expert.
            target = mlp if isinstance(mlp, LlamaMLP) else mlp.shared_expert
            if isinstance(mlp, SparseMoeBlock):
                prefix += "shared_expert."
            if target is None:
                raise ValueError(f"layer {layer}: its sparse block has no shared expert.")
            if part == "output_linear":
                target.down_proj.weight_loader(target.down_proj.weight, tensor)
                return [prefix + "down_proj.weight"]
            half = tensor.shape[0] // 2
            for shard in (0, 1):
                target.gate_up_proj.weight_loader(target.gate_up_proj.weight,
                                                  tensor.narrow(0, shard * half, half), shard)
            return [prefix + "gate_up_proj.weight"]
        if not isinstance(mlp, SparseMoeBlock):
            raise ValueError(f"checkpoint tensor of layer {layer}'s block_sparse_moe: the "
                             "layer has no experts (num_local_experts=0).")
        if part == "router.layer":
            replicated_weight_loader(mlp.gate.weight, tensor)
            return [prefix + "gate.weight"]
        whole = read_whole(tensor)
        for expert in mlp.local_experts:
            if part == "output_linear":
                mlp.load_expert_weight(expert, "down_proj", whole[expert])
            else:
                gate, up = whole[expert].chunk(2, dim=0)
                mlp.load_expert_weight(expert, "gate_proj", gate)
                mlp.load_expert_weight(expert, "up_proj", up)
        return [prefix + "w13", prefix + "w2"] if mlp.all_expert_weights_loaded else []

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Load HF-named tensors, real or lazy (each loader reads only this rank's part of
        a lazy one; the tied LM head on a later stage reads its own vocab shard of the
        embedding); raises ValueError on unknown names or unloaded parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        start, end = self.model.start_layer, self.model.end_layer
        tied = self.config.tie_word_embeddings
        mla = self.config.mla is not None  # its q_proj is its own, not a q/k/v part
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or name.startswith(_NOT_LOADED):
                continue
            name = canonical_weight_name(name)
            if name.startswith("model.layers."):
                index = int(name.split(".")[2])
                if not start <= index < end:
                    continue  # another pipeline stage's layer, or DeepSeek's MTP layers
            if name == "lm_head.weight" and tied:
                continue  # tied: the LM head reads the embedding
            if name == "model.embed_tokens.weight" and tied and "lm_head.weight" in params:
                # Tied, and this stage has the LM head but no embedding (pipeline split).
                head = params["lm_head.weight"]
                _attached_loader(head).weight_loader(head, tensor)
                loaded.add("lm_head.weight")
            if name.split(".")[0:2] == ["model", "embed_tokens"] and not self.ctx.is_first_pp_rank:
                continue
            if name.startswith(("model.norm.", "lm_head.")) and not self.ctx.is_last_pp_rank:
                continue
            gated_q = _Q_PROJ.fullmatch(name) if self.config.attn_output_gate else None
            if gated_q is not None:
                attn = cast(LlamaDecoderLayer, self.model.layers[int(gated_q[1])]).self_attn
                if not isinstance(attn, LlamaAttention):
                    raise ValueError(f"checkpoint tensor {name!r}: that layer is not attention.")
                attn.load_gated_q_proj(tensor)
                loaded.update({name.replace(".q_proj.", ".qkv_proj."),
                               name.replace(".q_proj.", ".attn_gate.")})
                continue
            fused = _GRANITE_FUSED.fullmatch(name)
            if fused is not None:
                loaded.update(self._load_granite_fused(int(fused[1]), fused[2], fused[3],
                                                       tensor))
                continue
            in_proj = _MAMBA_IN_PROJ.fullmatch(name)
            if in_proj is not None:
                mixer = cast(LlamaDecoderLayer, self.model.layers[int(in_proj[1])]).mamba
                if mixer is None:
                    raise ValueError(f"checkpoint tensor {name!r}: that layer is attention.")
                mixer.load_in_proj(tensor)
                loaded.add(name)
                continue
            expert = _EXPERT_WEIGHT.fullmatch(name)
            if expert is not None:
                layer, index, proj = int(expert[1]), int(expert[2]), expert[3]
                mlp = cast(LlamaDecoderLayer, self.model.layers[layer]).mlp
                if not isinstance(mlp, SparseMoeBlock):
                    raise ValueError(f"checkpoint tensor {name!r}: layer {layer} has no experts.")
                mlp.load_expert_weight(index, proj, tensor)
                if mlp.all_expert_weights_loaded:  # a count: checked after every tensor
                    loaded.update((f"model.layers.{layer}.mlp.w13",
                                   f"model.layers.{layer}.mlp.w2"))
                continue
            for ckpt_part, param_part, shard_id in _STACKED_PARAMS:
                if ckpt_part in name and not (mla and isinstance(shard_id, str)):
                    target = name.replace(ckpt_part, param_part)
                    param = params[target]
                    _attached_loader(param).weight_loader(param, tensor, shard_id)
                    break
            else:
                target = name
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                     f"{self.config.architecture}.")
                param = params[target]
                getattr(param, "weight_loader", replicated_weight_loader)(param, tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"parameters missing from the checkpoint: {missing}.")
