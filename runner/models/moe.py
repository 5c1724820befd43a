"""A sparse mixture-of-experts MLP (Qwen3-MoE's, Qwen2-MoE's, Mixtral's, OLMoE's): a softmax
router picks each token's top-k experts, each expert is a SwiGLU MLP, and a token's output
is the weighted sum of its experts' outputs, plus, for Qwen2-MoE, a dense shared expert's
output scaled by a sigmoid gate (Granite 4's shared MLP: ungated). DeepSeek-V3's router
instead scores by sigmoid and picks within the best groups of experts
(``grouped_sigmoid``; scheduler/config/moe_layout.py), in float32 as transformers does.

The experts run grouped by expert: one pair of matmuls per expert over the tokens routed
to it (no per-token loop), their outputs added in expert order as transformers adds them.
With tensor parallelism every rank holds every expert's slice of the intermediate
dimension (TP inside the experts; the shared expert is split the same way) and the partial
sums are all-reduced once per layer. With expert parallelism (``ctx.expert_parallel``) each
rank instead holds whole experts, a contiguous range of them, and runs the tokens routed to
those: every rank has every token (TP ranks share the hidden states), so the same one
all-reduce combines the experts' outputs and no all-to-all is needed. Spread over DP ranks
too (EP = DP x TP), a layer first gathers the DP ranks' tokens over its Gloo group, sums
the partial outputs over it, then the TP all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.parallel.communication import tp_all_reduce
from raylm.parallel.context import ParallelContext
from raylm.parallel.expert_parallel import DPExpertGroup
from raylm.parallel.layers import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    Weight,
    divide,
    new_param,
    read_whole,
    replicated_weight_loader,
    set_weight_loader,
)
from raylm.scheduler.config.moe_layout import GroupedSigmoidRouting


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, ctx: ParallelContext, dtype: torch.dtype,
                 shared_expert_intermediate_size: int = 0,
                 shared_expert_gated: bool = True,
                 grouped_sigmoid: GroupedSigmoidRouting | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], "
                             f"got {top_k}.")
        self.ctx = ctx
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.dp_group: DPExpertGroup | None = ctx.ep_group if ctx.expert_parallel else None
        if self.dp_group is not None:  # EP = DP x TP: whole experts per (DP, TP) rank
            self.first_expert, self.num_local_experts = expert_range(
                num_experts, *self.dp_group.ep_rank(ctx.tp_rank, ctx.tp_size))
            self.intermediate = intermediate_size
        elif ctx.expert_parallel and ctx.tp_size > 1:
            self.first_expert, self.num_local_experts = expert_range(num_experts, ctx.tp_rank,
                                                                     ctx.tp_size)
            self.intermediate = intermediate_size
        else:
            self.first_expert, self.num_local_experts = 0, num_experts
            self.intermediate = divide(intermediate_size, ctx.tp_size, "moe_intermediate_size")
        self.sliced = self.intermediate != intermediate_size
        self.grouped_sigmoid = grouped_sigmoid
        self.gate = _Router(num_experts, hidden_size, ctx, dtype,
                            score_correction=grouped_sigmoid is not None)
        # Per local expert: [gate; up] rows of this rank's slice, and down's columns of it.
        self.w13 = new_param((self.num_local_experts, 2 * self.intermediate, hidden_size), ctx,
                             dtype)
        self.w2 = new_param((self.num_local_experts, hidden_size, self.intermediate), ctx, dtype)
        self._loaded: set[tuple[int, str]] = set()
        # Tokens routed to each of this rank's experts since load (the expert-load metrics);
        # a tensor, so counting adds no host sync on CUDA.
        self.routed_tokens = torch.zeros(self.num_local_experts, dtype=torch.int64,
                                         device=ctx.device)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: _Router | None = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_expert_intermediate_size, ctx,
                                              dtype)
            if shared_expert_gated:  # Granite's shared MLP runs ungated
                self.shared_expert_gate = _Router(1, hidden_size, ctx, dtype)

    @property
    def local_experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def holds_expert(self, expert: int) -> bool:
        return expert in self.local_experts

    def expert_load(self) -> dict[int, int]:
        """Tokens routed to each of this rank's experts so far, by expert id."""
        return dict(zip(self.local_experts, self.routed_tokens.tolist(), strict=True))

    @property
    def all_expert_weights_loaded(self) -> bool:
        return len(self._loaded) == 3 * self.num_local_experts

    def missing_expert_weights(self) -> list[str]:
        """``experts.{e}.{proj}`` of every weight of this rank's experts not loaded yet."""
        return [f"experts.{e}.{proj}" for e in self.local_experts
                for proj in ("gate_proj", "up_proj", "down_proj")
                if (e, proj) not in self._loaded]

    def load_expert_weight(self, expert: int, proj: str, weight: Weight) -> None:
        """``experts.{expert}.{proj}.weight`` of the checkpoint: this rank's slice, or the
        whole expert under expert parallelism (another rank's expert is skipped unread)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (num_experts={self.num_experts}).")
        if not self.holds_expert(expert):
            return
        local = expert - self.first_expert
        size = self.intermediate
        start = self.ctx.tp_rank * size if self.sliced else 0
        if proj in ("gate_proj", "up_proj"):
            shard = weight.narrow(0, start, size)
            target = self.w13.data[local].narrow(0, 0 if proj == "gate_proj" else size, size)
        elif proj == "down_proj":
            shard = weight.narrow(1, start, size)
            target = self.w2.data[local]
        else:
            raise ValueError(f"unknown expert projection {proj!r}.")
        if tuple(shard.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert} {proj}: checkpoint shard has shape "
                             f"{tuple(shard.shape)}, parameter expects {tuple(target.shape)}.")
        target.copy_(read_whole(shard))  # experts run dense (a quantized one dequantized)
        self._loaded.add((expert, proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        weights = weights.to(x.dtype)
        if self.dp_group is not None:
            return self._forward_across_dp(x, weights, experts, self.dp_group)
        out = self._run_local_experts(x, weights, experts)
        if self.shared_expert is not None:
            # This rank's share of the shared expert, summed by the same all-reduce.
            out += self._shared(x)
        return tp_all_reduce(out, self.ctx)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their float32 weights [T, k]."""
        if self.grouped_sigmoid is not None:
            return self._route_grouped_sigmoid(x, self.grouped_sigmoid)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def _route_grouped_sigmoid(self, x: torch.Tensor, routing: GroupedSigmoidRouting
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3: the biased scores pick the groups (by their two best) and the
        experts within them; the unbiased scores weigh them."""
        assert self.gate.e_score_correction_bias is not None  # built with grouped_sigmoid
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        grouped = choice.view(-1, routing.n_group, self.num_experts // routing.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, routing.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1),
                                    float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * routing.routed_scaling_factor, experts

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared_expert is not None  # callers check
        shared = self.shared_expert(x)
        if self.shared_expert_gate is None:
            return shared
        return torch.sigmoid(self.shared_expert_gate(x)) * shared

    def _forward_across_dp(self, x: torch.Tensor, weights: torch.Tensor,
                           experts: torch.Tensor, group: DPExpertGroup) -> torch.Tensor:
        """Every DP rank's routed tokens through this rank's experts, the partial outputs
        summed over the ranks, this rank's rows kept. ``x`` may have no rows (a rank's
        dummy pass: it still joins every collective)."""
        (all_x, all_weights, all_experts), sizes = group.gather_rows([x, weights, experts])
        out = group.all_reduce_sum(self._run_local_experts(all_x, all_weights, all_experts))
        start = sum(sizes[:group.dp_rank])
        out = out[start:start + x.shape[0]]
        if self.shared_expert is not None:
            out = out + self._shared(x)
        # This TP rank's experts (and shared-expert slice); its TP peers hold the rest.
        return tp_all_reduce(out, self.ctx)

    def dummy_pass(self) -> None:
        """Join this layer's collectives with no rows (a DP rank without a forward)."""
        if self.dp_group is not None:
            self.forward(self.w13.new_empty((0, self.w13.shape[2])))

    def _run_local_experts(self, x: torch.Tensor, weights: torch.Tensor,
                           experts: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the tokens routed to them: [T, hidden], zero rows for
        tokens none of them serves."""
        flat = experts.reshape(-1)
        counts_t = torch.bincount(flat, minlength=self.num_experts)
        self.routed_tokens += counts_t[self.first_expert:self.first_expert
                                       + self.num_local_experts]
        if x.is_cuda:  # two grouped launches, no host sync (fused_moe_triton.py)
            from raylm.runner.models.fused_moe_triton import fused_experts

            return fused_experts(x, self.w13, self.w2, weights, experts, self.first_expert)
        return self.grouped_experts_torch(x, weights, experts, counts_t)

    def grouped_experts_torch(self, x: torch.Tensor, weights: torch.Tensor,
                              experts: torch.Tensor, counts_t: torch.Tensor) -> torch.Tensor:
        """The torch path (CPU; the reference of the Triton one): one pair of matmuls per
        local expert over its tokens, sliced by counts read on the host."""
        out = torch.zeros_like(x)
        # Tokens grouped by expert: the (token, slot) pairs sorted by expert id.
        order = torch.argsort(experts.reshape(-1), stable=True)
        counts = counts_t.tolist()
        tokens = order // self.top_k
        slot_weights = weights.reshape(-1)[order]
        start = sum(counts[:self.first_expert])  # the earlier ranks' experts' pairs
        for local, expert in enumerate(self.local_experts):
            n = counts[expert]
            if n == 0:
                continue
            idx = tokens[start:start + n]
            gate, up = F.linear(x.index_select(0, idx), self.w13[local]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[local])
            out.index_add_(0, idx, y * slot_weights[start:start + n, None])
            start += n
        return out


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """(first expert, count) of ``rank`` among ``size`` expert-parallel ranks: contiguous
    ranges, the first ``num_experts % size`` ranks one expert more."""
    base, extra = divmod(num_experts, size)
    return rank * base + min(rank, extra), base + (rank < extra)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token runs, split over TP like a dense
    MLP but left unreduced (its block all-reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, False, ctx=ctx, params_dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, ctx=ctx,
                                           params_dtype=dtype, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(F.silu(gate) * up)


class _Router(nn.Module):
    """The router's linear (``mlp.gate.weight``, [num_experts, hidden]), whole on every rank;
    also Qwen2-MoE's shared-expert gate ([1, hidden]). DeepSeek-V3's adds
    ``e_score_correction_bias``."""

    def __init__(self, num_experts: int, hidden_size: int, ctx: ParallelContext,
                 dtype: torch.dtype, score_correction: bool = False) -> None:
        super().__init__()
        # DeepSeek-V3 keeps its router in float32 (and the score bias beside it).
        self.weight = new_param((num_experts, hidden_size), ctx,
                                torch.float32 if score_correction else dtype)
        set_weight_loader(self.weight, replicated_weight_loader)
        self.e_score_correction_bias: nn.Parameter | None = None
        if score_correction:
            self.e_score_correction_bias = new_param((num_experts,), ctx, torch.float32)
            set_weight_loader(self.e_score_correction_bias, replicated_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
