"""Multi-head latent attention (DeepSeek-V3) over the paged cache, in the absorbed form.

The cache holds, per token and layer, the normalised latent ``c`` (kv_lora_rank) and the
rotated shared key ``k_pe`` (qk_rope_head_dim): one KV "head" of their concatenation, with
no separate value tensor. Head h's key is ``[W_UK_h c, k_pe]`` and its value ``W_UV_h c``
(``kv_b_proj`` stacks both per head), so

    score_h = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = [W_UK_h^T q_nope_h, q_pe_h] . [c, k_pe]
    out_h   = sum_s p_s W_UV_h c_s = W_UV_h (sum_s p_s c_s)

which is multi-query attention of the absorbed queries over the cached latents, each head's
latent output then taken up by its W_UV. Every step (prefill and decode) runs this form, so
the expanded keys and values never exist. With tensor parallelism each rank holds its
heads' slices of q_b_proj / kv_b_proj / o_proj and the whole latent cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Weight,
    new_param,
    read_whole,
    replicated_weight_loader,
    set_weight_loader,
)
from raylm.runner.attention.paged_attention import Attention, AttentionMetadata
from raylm.scheduler.config.mla_shape import MLAShape


class ReplicatedLinear(nn.Module):
    """A linear every TP rank holds whole (the down-projections into the latents)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param((output_size, input_size), ctx, dtype)
        set_weight_loader(self.weight, replicated_weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = new_param((output_size,), ctx, dtype)
            set_weight_loader(self.bias, replicated_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class HeadRows(nn.Module):
    """``kv_b_proj``: read as two per-head matrices, never run as a linear, so it is kept
    dense (a quantized checkpoint's is dequantized at load); this rank's heads' rows."""

    def __init__(self, rows_per_head: int, num_heads: int, input_size: int,
                 ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = new_param((rows_per_head * num_heads, input_size), ctx, dtype)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        rows = param.shape[0]
        shard = loaded_weight.narrow(0, self.ctx.tp_rank * rows, rows)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"kv_b_proj: checkpoint shard has shape {tuple(shard.shape)}, "
                             f"parameter expects {tuple(param.shape)}.")
        param.data.copy_(read_whole(shard))


class LatentRMSNorm(nn.Module):
    """transformers' DeepseekV3RMSNorm on a latent (computed in float32, weight applied
    after the cast back)."""

    def __init__(self, size: int, eps: float, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param((size,), ctx, dtype)
        set_weight_loader(self.weight, replicated_weight_loader)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
                 ) -> torch.Tensor:
    """RoPE on x [T, H, R] with cos/sin [T, 1, R] (rotate-half layout). Interleaved pairs
    come out de-interleaved (evens then odds), as transformers lays them out: queries and
    keys get the same layout, so their products are unchanged."""
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, shape: MLAShape, hidden_size: int, num_heads: int, bias: bool,
                 eps: float, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        self.num_heads = num_heads // ctx.tp_size
        if self.num_heads * ctx.tp_size != num_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by "
                             f"tensor_parallel_size={ctx.tp_size}.")
        qk = shape.qk_head_dim
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: LatentRMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if shape.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk, False, ctx=ctx,
                                               params_dtype=dtype)
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, shape.q_lora_rank, bias, ctx, dtype)
            self.q_a_layernorm = LatentRMSNorm(shape.q_lora_rank, eps, ctx, dtype)
            self.q_b_proj = ColumnParallelLinear(shape.q_lora_rank, num_heads * qk, False,
                                                 ctx=ctx, params_dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, shape.latent_dim, bias, ctx,
                                                   dtype)
        self.kv_a_layernorm = LatentRMSNorm(shape.kv_lora_rank, eps, ctx, dtype)
        # Per head: W_UK [qk_nope, kv_lora_rank] then W_UV [v, kv_lora_rank] (rows).
        self.kv_b_proj = HeadRows(shape.qk_nope_head_dim + shape.v_head_dim, self.num_heads,
                                  shape.kv_lora_rank, ctx, dtype)
        self.o_proj = RowParallelLinear(num_heads * shape.v_head_dim, hidden_size, bias,
                                        ctx=ctx, params_dtype=dtype)
        # The cache's one KV head: [c, k_pe]; the value is the key's first kv_lora_rank
        # channels (latent_cache: no value tensor).
        self.attn = Attention(self.num_heads, shape.latent_dim, 1, scale=shape.scale,
                              latent_cache=True)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's W_UK [H, qk_nope, L] and W_UV [H, v, L] as views of kv_b_proj."""
        s = self.shape
        w = self.kv_b_proj.weight.view(self.num_heads, s.qk_nope_head_dim + s.v_head_dim,
                                       s.kv_lora_rank)
        return w[:, :s.qk_nope_head_dim], w[:, s.qk_nope_head_dim:]

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        s, t = self.shape, hidden_states.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden_states)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None \
                and self.q_b_proj is not None  # built together
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(t, self.num_heads, s.qk_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = cos_sin
        q_pe = rotate_pairs(q_pe, cos, sin, s.rope_interleave)
        k_pe = rotate_pairs(k_pe.unsqueeze(1), cos, sin, s.rope_interleave)
        w_uk, w_uv = self._absorbed()
        # [H, T, qk_nope] @ [H, qk_nope, L] -> [T, H, L]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_pe], dim=-1)
        key = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, L + R]
        out = self.attn(query, key, key, meta).reshape(t, self.num_heads, s.latent_dim)
        # [H, T, L] @ [H, L, v] -> [T, H * v]
        values = torch.bmm(out[..., :s.kv_lora_rank].transpose(0, 1), w_uv.transpose(1, 2))
        return self.o_proj(values.transpose(0, 1).reshape(t, self.num_heads * s.v_head_dim))
