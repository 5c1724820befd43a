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
from typing import TYPE_CHECKING, cast

import torch

from raylm.parallel.layers import PackedLinearWeight
from raylm.runner.cpp_build import load_cpp_operators
from raylm.runner.quantization import packed_linear
from raylm.runner.quantization.packed_linear import PackedLinear
from raylm.runner.rotary import RotaryEmbedding
from raylm.scheduler.config import envs

if TYPE_CHECKING:
    from raylm.runner.attention.paged_attention import AttentionMetadata
    from raylm.runner.models.llama import LlamaAttention, LlamaModel

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "decode_layer.cpp")


@functools.cache
def load_decode_layer_kernel() -> bool:
    """Whether torch.ops.raylm_decode.llama_layer is there to call (built now if needed)."""
    return load_cpp_operators("raylm_decode_layer", _SOURCE, "the eager layers")


@dataclass(frozen=True)
class _LayerArgs:
    """One layer's constant arguments: norms, and its four linears' packed codes."""

    attention: LlamaAttention
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    codes: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    out_features: tuple[int, ...]
    bits: tuple[int, ...]  # 0: a dense linear (oneDNN's packed weight in ``codes``)
    groups: tuple[int, ...]


def _plain_layer_args(layer: object) -> _LayerArgs | None:
    """The layer's arguments, or None where the fused call does not compute it exactly."""
    from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, RMSNorm

    if not isinstance(layer, LlamaDecoderLayer):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if (not isinstance(attn, LlamaAttention) or not isinstance(mlp, LlamaMLP)
            or layer.recurrent_mixer is not None or layer.falcon is not None
            or layer.residual_multiplier is not None
            or layer.pre_feedforward_layernorm is not None
            or not isinstance(layer.input_layernorm, RMSNorm)
            or not isinstance(layer.post_attention_layernorm, RMSNorm)
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps):
        return None
    if (attn.q_norm is not None or attn.attn_gate is not None or not attn.use_rope
            or attn.key_multiplier != 1.0 or attn.attn.sliding_window is not None
            or attn.attn.softcap or attn.attn.latent_cache or attn.attn.kv_group
            or mlp.gelu_tanh or mlp.multipliers is not None):
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(lin.bias is not None or lin.lora is not None or lin.ctx.tp_size != 1
           for lin in linears):
        return None
    weights = [_linear_weight(lin) for lin in linears]
    if any(w is None for w in weights):
        return None
    codes, scales, n, bits, groups = zip(*(w for w in weights if w is not None), strict=True)
    return _LayerArgs(attn, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                      layer.input_layernorm.eps, codes, scales, n, bits, groups)


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
    def build(cls, model: LlamaModel) -> FusedDecodeLayers | None:
        """For a model whose every layer on this stage qualifies (module docstring)."""
        if not envs.cpu_decode_layer() or model.ctx.device.type != "cpu":
            return None
        if model.ctx.tp_size != 1 or model.aux_hidden_layers or len(model.rotary_embs) != 1:
            return None
        layers = [_plain_layer_args(layer)
                  for layer in model.layers[model.start_layer:model.end_layer]]
        args = [a for a in layers if a is not None]
        if not args or len(args) != len(layers) or len({a.eps for a in args}) != 1:
            return None
        rotary = cast(RotaryEmbedding, model.rotary_embs[0])
        dtype = args[0].input_norm.dtype
        if (rotary.cos_cache.shape[-1] != args[0].attention.head_dim
                or dtype not in (torch.float32, torch.bfloat16)
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
                and self.layers[0].attention.attn.kv_connector is None
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
        write = meta.write_index(self.layers[0].attention.num_kv_heads)
        op = self._op
        for a in self.layers:
            attn = a.attention
            cache = attn.attn.kv_cache
            if cache is None:
                raise RuntimeError("KV cache is not bound; call initialize_kv_cache() first.")
            hidden, residual = op(hidden, residual, a.input_norm, a.post_norm, self.eps,
                                  a.codes, a.scales, a.out_features, a.bits, a.groups,
                                  cos, sin, cache[0], cache[1], write, ragged.block_table,
                                  ragged.token_row, ragged.kv_len, attn.num_heads,
                                  attn.num_kv_heads, attn.attn.scale, ragged.window)
        assert residual is not None
        return hidden, residual
