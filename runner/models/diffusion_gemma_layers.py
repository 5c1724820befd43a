"""DiffusionGemma's layer parts, written once with transformers' numerics: the RMSNorm
(float32, ``x * (mean(x^2) + eps) ** -0.5``, scaled by ``weight``), the attention over the
paged cache, the dense MLP beside the routed experts, and the self-conditioning block.

Parameters are named as the checkpoint's ``model.decoder.*`` tensors, so loading maps
names one to one (diffusion_gemma.py). Every rank keeps every weight (TP = 1 for now).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.runner.attention.paged_attention import Attention, AttentionMetadata
from raylm.runner.models.diffusion_gemma_config import DiffusionGemmaConfig, DiffusionLayerShape


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: the loader overwrites every parameter (and checks it did).
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DiffusionRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype, device=device) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class Linear(nn.Module):
    """A bias-free linear whose weight is the checkpoint's ``[out, in]`` tensor."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DiffusionAttention(nn.Module):
    """q/k/v projections, per-head q/k norms and an unscaled v norm, RoPE, then raylm's
    paged attention (scale 1: the norms set the scores' size). The global layers have no
    v_proj: their value is k_proj's output before k_norm and RoPE."""

    def __init__(self, cfg: DiffusionGemmaConfig, shape: DiffusionLayerShape,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        heads, d, kv = cfg.num_attention_heads, shape.head_dim, shape.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv, d
        self.q_proj = Linear(cfg.hidden_size, heads * d, dtype, device)
        self.k_proj = Linear(cfg.hidden_size, kv * d, dtype, device)
        self.v_proj = None if shape.value_is_key else Linear(cfg.hidden_size, kv * d, dtype,
                                                             device)
        self.o_proj = Linear(heads * d, cfg.hidden_size, dtype, device)
        eps = cfg.rms_norm_eps
        self.q_norm = DiffusionRMSNorm(d, eps, dtype, device)
        self.k_norm = DiffusionRMSNorm(d, eps, dtype, device)
        self.v_norm = DiffusionRMSNorm(d, eps, dtype, device, with_scale=False)
        self.attn = Attention(heads, d, kv, scale=1.0, sliding_window=shape.sliding_window)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = cos_sin
        q = _rotate(self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim)),
                    cos, sin)
        raw_k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        raw_v = raw_k if self.v_proj is None else self.v_proj(x).view(
            t, self.num_kv_heads, self.head_dim)
        k = _rotate(self.k_norm(raw_k), cos, sin)
        v = self.v_norm(raw_v)
        return self.o_proj(self.attn(q, k, v, meta))


class GatedMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)): the dense MLP, and the self-conditioning block's."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, dtype, device)
        self.up_proj = Linear(hidden, intermediate, dtype, device)
        self.down_proj = Linear(intermediate, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Router(nn.Module):
    """Softmax over the experts of an unscaled-normed, rescaled input; the top k weights
    renormalised and multiplied by each chosen expert's own scale."""

    def __init__(self, cfg: DiffusionGemmaConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.top_k = cfg.top_k_experts
        self.root = hidden ** -0.5
        self.norm = DiffusionRMSNorm(hidden, cfg.rms_norm_eps, dtype, device, with_scale=False)
        self.proj = Linear(hidden, cfg.num_experts, dtype, device)
        self.scale = _param(hidden, dtype=dtype, device=device)
        self.per_expert_scale = _param(cfg.num_experts, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.root
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Experts(nn.Module):
    """The checkpoint's stacked experts: ``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]. The (token, expert) pairs are sorted by expert and run as one grouped
    matmul per projection (transformers' default ``grouped_mm`` path, so the same sums);
    each token's top-k outputs are then weighted and summed."""

    def __init__(self, cfg: DiffusionGemmaConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = _param(e, 2 * i, h, dtype=dtype, device=device)
        self.down_proj = _param(e, h, i, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                index: torch.Tensor) -> torch.Tensor:
        tokens, top_k = index.shape
        experts, perm = torch.sort(index.reshape(-1))
        # histc counts on every device (bincount's output size is data-dependent)
        counts = torch.histc(experts.float(), bins=self.num_experts, min=0,
                             max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = _grouped_mm(x[perm // top_k], self.gate_up_proj.transpose(-2, -1),
                               offsets).chunk(2, dim=-1)
        y = _grouped_mm(F.gelu(gate, approximate="tanh") * up,
                        self.down_proj.transpose(-2, -1), offsets)
        y = y * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return y[inverse].view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` grouped by ``offsets`` (cumulative), each group times its
    ``weight`` [E, in, out]: torch's grouped matmul, or a loop of matmuls where it cannot
    run (its strides must be multiples of 16 bytes)."""
    grouped = getattr(F, "grouped_mm", None)
    if grouped is not None:
        try:
            return grouped(x.to(weight.dtype), weight, offs=offsets)
        except RuntimeError:
            pass
    out = x.new_zeros(x.shape[0], weight.shape[2])
    start = 0
    for i, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[i], out=out[start:end])
        start = end
    return out


class DiffusionLayer(nn.Module):
    """One layer, run by both passes (the encoder's and the decoder's weights are tied);
    only the output scalar is each pass's own."""

    def __init__(self, cfg: DiffusionGemmaConfig, layer: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps

        def norm() -> DiffusionRMSNorm:
            return DiffusionRMSNorm(hidden, eps, dtype, device)

        self.layer_type = cfg.layers[layer].layer_type
        self.self_attn = DiffusionAttention(cfg, cfg.layers[layer], dtype, device)
        self.self_attn.attn.decoder_layer = layer
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, dtype, device)
        self.router = Router(cfg, dtype, device)
        self.experts = Experts(cfg, dtype, device)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
        self.pre_feedforward_layernorm_2 = norm()
        self.layer_scalar = _param(1, dtype=dtype, device=device)  # the decoder's
        self.encoder_layer_scalar = _param(1, dtype=dtype, device=device)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata, encoder: bool) -> torch.Tensor:
        h = self.post_attention_layernorm(
            self.self_attn(cos_sin, self.input_layernorm(x), meta))
        residual = x + h
        dense = self.post_feedforward_layernorm_1(
            self.mlp(self.pre_feedforward_layernorm(residual)))
        weights, index = self.router(residual)
        routed = self.post_feedforward_layernorm_2(
            self.experts(self.pre_feedforward_layernorm_2(residual), weights, index))
        out = residual + self.post_feedforward_layernorm(dense + routed)
        return out * (self.encoder_layer_scalar if encoder else self.layer_scalar)


class SelfConditioning(GatedMLP):
    """The previous step's logits, as soft embeddings, through a gated MLP added to the
    canvas embeddings, then an unscaled norm."""

    def __init__(self, cfg: DiffusionGemmaConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.pre_norm = DiffusionRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_norm = DiffusionRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device,
                                          with_scale=False)

    def condition(self, embeds: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
        return self.post_norm(embeds + self(self.pre_norm(signal)))
