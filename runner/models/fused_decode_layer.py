"""A Llama's decode steps on the CPU: each decoder layer as one C++ call
(``csrc/decode_layer.cpp``, torch.ops.raylm_decode.llama_layer).

At batch 1 a layer's arithmetic (four linears, attention over a short context) takes about
as long as the eager layer's twenty-odd operator calls from Python; one call per layer
leaves the arithmetic. The call runs the same linear and attention operators, and rounds
every intermediate where the eager layer does, so its tokens are the eager path's.

It applies to a plain Llama layer (RMSNorm, full rotary, SiLU MLP, no biases, no q/k norm,
no window, no soft cap) whose linears run on the C++ quantized kernel (without act order)
or on oneDNN's packed dense weights, one TP rank, no LoRA, no KV connector, and to steps
whose every token takes the C++ ragged attention kernel (decodes and speculative rows, no
prefill), with few enough rows for the quantized kernel's row path. Anything else runs the
eager layer. RAYLM_CPU_DECODE_LAYER=0 turns it off. docs/architecture.md §6.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from raylm.parallel.layers import ColumnParallelLinear, PackedLinearWeight, RowParallelLinear
from raylm.runner.cpp_build import load_cpp_operators
from raylm.runner.quantization import packed_linear
from raylm.runner.quantization.packed_linear import PackedLinear
from raylm.scheduler.config import envs

if TYPE_CHECKING:
    from raylm.runner.attention.paged_attention import Attention, AttentionMetadata

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "decode_layer.cpp")


@functools.cache
def load_decode_layer_kernel() -> bool:
    """Whether torch.ops.raylm_decode.llama_layer is there to call (built now if needed)."""
    return load_cpp_operators("raylm_decode_layer", _SOURCE, "the eager layers")


@dataclass(frozen=True)
class PlainLayer:
    """What the fused call reads of a plain Llama decoder layer (RMSNorm, full rotary, SiLU
    MLP, no q/k norm, no window, no soft cap): llama.py ``LlamaDecoderLayer.plain_layer``
    says which layers are plain."""

    attn: Attention  # its paged attention: heads, scale, KV cache
    linears: tuple[ColumnParallelLinear | RowParallelLinear, ...]  # qkv, o, gate_up, down
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float


@dataclass(frozen=True)
class _LayerArgs:
    """One layer's constant arguments: norms, and its four linears' packed weights."""

    attn: Attention
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    codes: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    out_features: tuple[int, ...]
    bits: tuple[int, ...]  # 0: a dense linear (oneDNN's packed weight in ``codes``)
    groups: tuple[int, ...]


def _layer_args(layer: PlainLayer | None) -> _LayerArgs | None:
    """The layer's arguments, or None where the fused call does not compute it exactly."""
    if layer is None or any(lin.bias is not None or lin.lora is not None
                            or lin.ctx.tp_size != 1 for lin in layer.linears):
        return None
    weights = [_linear_weight(lin) for lin in layer.linears]
    if any(w is None for w in weights):
        return None
    codes, scales, n, bits, groups = zip(*(w for w in weights if w is not None), strict=True)
    return _LayerArgs(layer.attn, layer.input_norm, layer.post_norm, layer.eps, codes, scales,
                      n, bits, groups)


_NO_SCALES = torch.empty(0)


def _linear_weight(linear: PackedLinearWeight
                   ) -> tuple[torch.Tensor, torch.Tensor, int, int, int] | None:
    """(codes, scales, out features, bits, group) as the C++ layer takes a linear: the
    quantized kernel's packed codes, or oneDNN's packed dense weight with bits 0 (what
    parallel/layers.py ``linear`` multiplies by); None for any other form."""
    q = linear.quantized
    if q is None:
        if linear.packed_weight is None:
            return None
        return linear.packed_weight, _NO_SCALES, linear.weight.shape[0], 0, 0
    if not isinstance(q, PackedLinear) or q.input_order is not None:
        return None
    return q.codes, q.scales, q.out_features, q.bits, q.group_size


class FusedDecodeLayers:
    """The model's layers as one C++ call each, for the steps it applies to."""

    def __init__(self, layers: list[_LayerArgs], eps: float, dtype: torch.dtype) -> None:
        self.layers = layers
        self.eps = eps
        self.dtype = dtype
        self._op = torch.ops.raylm_decode.llama_layer.default
        quantized = any(bits for a in layers for bits in a.bits)
        self.max_rows = self._max_rows(dtype, quantized)

    @classmethod
    def build(cls, layers: list[PlainLayer | None], device: torch.device,
              rotary_dim: int) -> FusedDecodeLayers | None:
        """For a stage whose every layer (``layers``, None where a layer is not plain)
        qualifies (module docstring); ``rotary_dim``: the channels its rotary table turns."""
        if not envs.cpu_decode_layer() or device.type != "cpu":
            return None
        args = [a for a in map(_layer_args, layers) if a is not None]
        if not args or len(args) != len(layers) or len({a.eps for a in args}) != 1:
            return None
        dtype = args[0].input_norm.dtype
        if (rotary_dim != args[0].attn.head_dim or dtype not in (torch.float32, torch.bfloat16)
                or not load_decode_layer_kernel()):
            return None
        fused = cls(args, args[0].eps, dtype)
        logger.info("decode steps of up to %d rows run each of this stage's %d layers as "
                    "one C++ call (RAYLM_CPU_DECODE_LAYER=0: eager layers)", fused.max_rows,
                    len(args))
        return fused

    @staticmethod
    def _max_rows(dtype: torch.dtype, quantized: bool) -> int:
        """Rows the quantized kernel's row path takes (packed_linear.py): above them each
        linear decodes its weight for a dense matmul, which the fused call does not. Dense
        linears take any rows (a decode step's rows are bounded by max_num_seqs)."""
        if not quantized:
            return 1 << 30
        if dtype == torch.bfloat16 and packed_linear._has_amx():
            return packed_linear.FUSED_MAX_ROWS_BF16
        return packed_linear.FUSED_MAX_ROWS

    def applies(self, meta: AttentionMetadata, hidden: torch.Tensor) -> bool:
        """Whether this step's every token takes the C++ ragged kernel, within the rows."""
        ragged = meta.ragged
        return (ragged is not None and ragged.token_index is None
                and self.layers[0].attn.kv_connector is None
                and ragged.block_table is not None and not meta.prefills
                and meta.equal_rows is None and meta.tiles is None
                and hidden.dtype == self.dtype and 0 < hidden.shape[0] <= self.max_rows)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ragged = meta.ragged
        assert ragged is not None and ragged.block_table is not None  # applies() held
        assert ragged.token_row is not None and ragged.kv_len is not None
        cos, sin = (t.contiguous() for t in cos_sin)
        if not hidden.is_contiguous():
            hidden = hidden.contiguous()
        write = meta.write_index(self.layers[0].attn.num_kv_heads)
        op = self._op
        for a in self.layers:
            attn = a.attn
            cache = attn.kv_cache
            if cache is None:
                raise RuntimeError("KV cache is not bound; call initialize_kv_cache() first.")
            hidden, residual = op(hidden, residual, a.input_norm, a.post_norm, self.eps,
                                  a.codes, a.scales, a.out_features, a.bits, a.groups,
                                  cos, sin, cache[0], cache[1], write, ragged.block_table,
                                  ragged.token_row, ragged.kv_len, attn.num_heads,
                                  attn.num_kv_heads, attn.scale, ragged.window)
        assert residual is not None
        return hidden, residual
