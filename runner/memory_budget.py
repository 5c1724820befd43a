"""How much of a device's memory the KV cache gets: what a step can touch is reserved first.

The reserve is sized from the step's bounds (the token budget, the rows, the ragged
kernel's workspace cap), never from ``max_num_seqs x max_model_len``: a long-context model
(131072 positions) would otherwise reserve more than the device has. When what is left
cannot hold one request of ``max_model_len``, the error names the longest that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from raylm.parallel.context import ParallelContext
from raylm.runner.attention.paged_attention import (
    RAGGED_MAX_QUERY_LEN,
    max_ragged_pairs,
    ragged_bytes_per_pair,
)
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.scheduler.config.engine_config import EngineConfig

# NCCL's buffers per communicator (channels x peers x NCCL_BUFFSIZE, plus its proxy):
# a few hundred MiB on 8-GPU nodes, not visible to torch's allocator.
NCCL_COMMUNICATOR_RESERVE_BYTES = 256 << 20
FIXED_RESERVE_BYTES = 256 << 20  # CUDA context slack, allocator fragmentation
GIB = 1 << 30


@dataclass(frozen=True)
class RankAttentionShape:
    """One rank's attention heads (after the TP split)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, dc: DecoderConfig, tp_size: int) -> RankAttentionShape:
        return cls(num_heads=max(1, dc.num_attention_heads // tp_size),
                   num_kv_heads=max(1, dc.num_key_value_heads // tp_size),
                   head_dim=dc.head_dim)

    def max_ragged_pairs(self, block_size: int, elem: int) -> int:
        return max_ragged_pairs(self.num_heads, self.num_kv_heads, self.head_dim, block_size,
                                elem)


def step_reserve_bytes(config: EngineConfig, ctx: ParallelContext, elem: int,
                       attention_backend: str = "native", cuda_graphs: bool = False) -> int:
    """Device memory a rank needs besides weights and the KV cache, for the worst step:
    activations of a full token budget, the sampler's float32 logits, attention's
    workspace (none for the Triton kernel, which reads the cache in place; natively the
    ragged kernel's chunk and a prefill chunk's gathered context and mask), the CUDA
    graphs' own pool (one decode batch's activations), and the communicators' buffers."""
    dc = DecoderConfig.from_hf(config.model_config.hf_config)
    sched = config.scheduler_config
    block_size = config.cache_config.block_size
    tokens = sched.max_num_batched_tokens
    width = dc.hidden_size * 4 + 3 * dc.intermediate_size
    activations = 2 * tokens * width * elem
    spec = config.speculative_config
    rows_sampled = sched.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
    logits = min(rows_sampled, tokens) * dc.vocab_size * 4 * 6  # float32 sampler temporaries
    shape = RankAttentionShape.of(dc, ctx.tp_size)
    # The torch ragged kernel: the pairs of every short row, up to its workspace cap.
    short_tokens = min(tokens, sched.max_num_seqs * RAGGED_MAX_QUERY_LEN)
    pairs = short_tokens * -(-sched.max_model_len // block_size)
    per_pair = ragged_bytes_per_pair(shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                     block_size, elem)
    ragged = min(pairs, shape.max_ragged_pairs(block_size, elem)) * per_pair
    # A prefill chunk with context: its K/V gathered from the cache, the boolean mask and
    # sdpa's additive copy of it (one chunk at a time, one layer at a time).
    chunk = min(tokens, sched.max_model_len)
    prefill = (sched.max_model_len * 2 * shape.num_kv_heads * shape.head_dim * elem
               + chunk * sched.max_model_len * (1 + elem))
    if attention_backend == "triton":
        ragged = prefill = 0
    graphs = 2 * sched.max_num_seqs * width * elem if cuda_graphs else 0
    groups = sum(g is not None for g in (ctx.tp_group, ctx.pp_group))
    groups += 2 if ctx.pp_group is not None else 0  # the sampled-id broadcast, the p2p pair
    return (activations + logits + ragged + prefill + graphs
            + groups * NCCL_COMMUNICATOR_RESERVE_BYTES + FIXED_RESERVE_BYTES)


def kv_cache_budget_bytes(free: int, total: int, gpu_memory_utilization: float,
                          reserve: int) -> int:
    """What the utilisation cap leaves of the free memory, minus the step reserve."""
    return int(free - total * (1.0 - gpu_memory_utilization)) - reserve


def num_kv_blocks_for(budget: int, bytes_per_block: int, block_size: int,
                      max_model_len: int, what: str, blocks_per_request: int | None = None
                      ) -> int:
    """Blocks the budget holds; a ValueError when they cannot hold one request of
    ``max_model_len`` tokens (``blocks_per_request``: the most it holds at once, when a
    sliding window frees the rest), naming the longest that fits (``what`` says where the
    budget came from, for the message)."""
    num_blocks = max(0, budget) // bytes_per_block
    fits = num_blocks * block_size
    needed = -(-max_model_len // block_size) if blocks_per_request is None \
        else blocks_per_request
    if num_blocks < needed:
        need = needed * bytes_per_block
        held = (f"the longest max_model_len this memory holds is {fits}. Lower max_model_len"
                if blocks_per_request is None else
                f"a request holds up to {needed} blocks at once (its sliding window and the "
                "tokens in flight). Lower max_num_batched_tokens")
        raise ValueError(
            f"to serve one request of max_model_len={max_model_len} the KV cache needs "
            f"{need / GIB:.2f} GiB, more than the {max(0, budget) / GIB:.2f} GiB available "
            f"to it ({what}); {held}, or raise gpu_memory_utilization / "
            "kv_cache_memory_bytes.")
    return int(num_blocks)
