"""Tensor-parallel linear layers (Megatron layout, vLLM's names).

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: it
``narrow``s this rank's shard out of the checkpoint tensor or of a lazy handle to it
(``LazyWeight``: each TP rank then reads only its range), and reads whole, through
``read_whole``, only what every rank keeps entire (a row-parallel bias). Column-parallel
layers split the output features, row-parallel ones the input features (then all-reduce).
A linear may carry a ``lora`` hook (``LinearLoRA``: raylm.runner.lora adds the step's
adapter products to its local output, before a row-parallel all-reduce).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from raylm.parallel.communication import tp_all_gather, tp_all_reduce
from raylm.parallel.context import ParallelContext
from raylm.scheduler.config.validation import check_rank


class LazyWeight(Protocol):
    """A checkpoint tensor not read yet (runner/model_loader.LazyTensor): what the weight
    loaders use of a ``torch.Tensor`` (``shape``, ``dim()``, ``narrow``), plus ``read()``
    for all of it; each read takes only what it returns from the checkpoint."""

    shape: torch.Size

    def dim(self) -> int: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """That range alone, read now, as a contiguous tensor in the checkpoint's dtype."""
        ...

    def read(self) -> torch.Tensor:
        """The whole tensor, read now."""
        ...


@runtime_checkable
class QuantizedShard(Protocol):
    """A checkpoint weight kept quantized (runner/quantization/group_quantized.py): it
    narrows like a tensor, and a layer keeps it for the runner to pack after loading."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def bits(self) -> int: ...

    @property
    def kind(self) -> str: ...

    def narrow(self, dim: int, start: int, length: int) -> QuantizedShard: ...

    def pad_rows(self, rows: int) -> QuantizedShard:
        """Zero rows appended up to ``rows`` (a vocabulary shard's padding)."""
        ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


class QuantizedMatmul(Protocol):
    """A layer's quantized weight as the runner packed it (runner/quantization)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T, in x's dtype."""
        ...

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of W, dequantized (an embedding lookup)."""
        ...


# What a weight_loader receives: a tensor read whole (GGUF's dequantized ones), a lazy one,
# or one kept quantized.
Weight = torch.Tensor | LazyWeight | QuantizedShard


def read_whole(weight: Weight) -> torch.Tensor:
    """All of a checkpoint tensor: a ``torch.Tensor`` as it is, a lazy one read now, a
    quantized one dequantized."""
    if isinstance(weight, QuantizedShard):
        return weight.dequantize()
    return weight if isinstance(weight, torch.Tensor) else weight.read()


class LinearLoRA(Protocol):
    """A linear's LoRA hook (raylm.runner.lora.lora_linear.LoRALinear)."""

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the step's adapter products of ``x`` to ``out``, in place."""
        ...


class WeightLoader(Protocol):
    """A parameter's ``weight_loader``: copies this rank's shard of ``loaded_weight`` into
    ``param`` (or into any tensor shaped like it: LoRA shards slices with it)."""

    def __call__(self, param: torch.Tensor, loaded_weight: Weight,
                 shard_id: object = None) -> None: ...


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    # torch's Parameter declares no such attribute: the loaders are tagged on at runtime.
    param.weight_loader = loader  # type: ignore[attr-defined]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}.")
    return numerator // denominator


def get_pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) owned by ``pp_rank``; the first ``num_layers % pp_size`` ranks
    take one extra layer."""
    check_rank("pp_rank", pp_rank, pp_size)
    if num_layers < pp_size:
        raise ValueError(
            f"num_hidden_layers={num_layers} is smaller than pipeline_parallel_size={pp_size}.")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


# Up to this many rows, a CPU linear runs as (W @ x^T)^T: oneDNN/MKL pick a faster kernel
# for a tall-skinny weight-major product; for larger batches the plain product is as fast.
_CPU_TRANSPOSED_LINEAR_MAX_ROWS = 64


def pack_cpu_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU linear weight (fp32 or bf16), or None where there is
    none to make. A linear over it beats MKL's GEMM on the same weight (MKL takes its
    slower path on non-Intel CPUs, oneDNN does not); vLLM-CPU packs its linears the same
    way. The rounding differs from MKL's in the last bits, as MKL's own differs between
    batch sizes."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    except RuntimeError:  # oneDNN's bf16 path needs AVX-512 (BW/VL/DQ); MKL's GEMM then
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed_weight: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on CPU over ``packed_weight`` (pack_cpu_linear_weight) when there is one,
    else in the faster CPU form for small batches (decode). With a bias and no packed
    weight it stays F.linear (one fused addmm, HF's rounding)."""
    if packed_weight is not None and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias,
                                                  "none", [], "")
    if (bias is None and x.device.type == "cpu" and x.dim() == 2
            and 1 < x.shape[0] <= _CPU_TRANSPOSED_LINEAR_MAX_ROWS):
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(x, weight, bias)


class QuantizableWeight:
    """Mixin for a layer whose ``weight`` may arrive quantized. Its loaders keep quantized
    shards in ``quantized_parts`` (row offset, shard) instead of writing the dense
    parameter; after loading, the runner packs them into ``quantized``
    (runner/quantization/quantize_model.py) and the dense parameter becomes a zero-stride
    placeholder of the same shape (LoRA and TP checks read its shape and dtype)."""

    weight: nn.Parameter
    quantized: QuantizedMatmul | None = None

    @property
    def quantized_parts(self) -> list[tuple[int, QuantizedShard]]:
        parts: list[tuple[int, QuantizedShard]] = self.__dict__.setdefault(
            "_quantized_parts", [])
        return parts

    def _place(self, target: torch.Tensor, row_offset: int, shard: torch.Tensor | QuantizedShard,
               what: str) -> None:
        """``shard`` into ``target`` (rows ``row_offset``.. of the weight): copied, or kept
        quantized."""
        _check_shape(target, shard, what)
        if isinstance(shard, QuantizedShard):
            self.quantized_parts.append((row_offset, shard))
        else:
            target.copy_(shard)


class PackedLinearWeight(QuantizableWeight):
    """Mixin for a layer whose ``weight`` a CPU linear may read packed. The dense weight
    stays (loaders, TP checks and a tied embedding read it); the packed copy is made once
    the weights are loaded (``process_weights_after_loading``), unless the weight runs
    quantized."""

    packed_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        if self.quantized is None:
            self.packed_weight = pack_cpu_linear_weight(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias): quantized, packed, or dense."""
        if self.quantized is not None:
            out = self.quantized(x)
            return out if bias is None else out + bias
        return linear(x, self.weight, bias, self.packed_weight)


def process_weights_after_loading(model: nn.Module, pack_cpu_linears: bool) -> None:
    """After a model's weights are loaded: pack its CPU linears when asked."""
    if not pack_cpu_linears:
        return
    for module in model.modules():
        if isinstance(module, PackedLinearWeight):
            module.process_weights_after_loading()


def _check_shape(param: torch.Tensor, shard: torch.Tensor | QuantizedShard, name: str) -> None:
    if tuple(param.shape) != tuple(shard.shape):
        raise ValueError(
            f"{name}: checkpoint shard has shape {tuple(shard.shape)}, "
            f"parameter expects {tuple(param.shape)}.")


def replicated_weight_loader(param: torch.Tensor, loaded_weight: Weight,
                             shard_id: object = None) -> None:
    """A parameter every rank keeps whole (norms, a router): the whole tensor, its shape
    checked before it is read."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                         f"parameter expects {tuple(param.shape)}.")
    param.data.copy_(read_whole(loaded_weight))


def new_param(shape: tuple[int, ...], ctx: ParallelContext, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader (which checks it was).
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=ctx.device), requires_grad=False)


class ColumnParallelLinear(PackedLinearWeight, nn.Module):
    """y = x W^T + b with W split along the output dim; output stays sharded unless
    ``gather_output``."""

    def __init__(self, input_size: int, output_size: int, bias: bool, *, ctx: ParallelContext,
                 params_dtype: torch.dtype, gather_output: bool = False) -> None:
        super().__init__()
        self.ctx = ctx
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, ctx.tp_size, "output_size")
        self.gather_output = gather_output
        self.lora: LinearLoRA | None = None
        self.weight = new_param((self.output_size_per_partition, input_size), ctx, params_dtype)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias = None
        if bias:
            self.bias = new_param((self.output_size_per_partition,), ctx, params_dtype)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        size = param.shape[0]
        shard = loaded_weight.narrow(0, self.ctx.tp_rank * size, size)
        if param is self.weight:
            self._place(param.data, 0, shard, type(self).__name__)
        else:
            _check_shape(param, shard, type(self).__name__)
            param.data.copy_(read_whole(shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.apply(x, out)
        return tp_all_gather(out, self.ctx) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stacked into one matmul (gate_up_proj).
    ``shard_id`` is the index of the projection in ``output_sizes``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, *,
                 ctx: ParallelContext, params_dtype: torch.dtype) -> None:
        for size in output_sizes:
            divide(size, ctx.tp_size, "output_size")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, ctx=ctx, params_dtype=params_dtype)
        self.output_sizes_per_partition = [size // ctx.tp_size for size in output_sizes]

    def forward_split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One output per projection (this rank's shard of each). On CPU with MKL each
        projection is its own matmul over a row block (a view) of the fused weight, which
        beats one wide matmul whose output is then read through strided chunks. Elsewhere,
        a packed CPU weight included (one oneDNN matmul is as fast as two), one fused
        matmul split into views."""
        if (x.device.type != "cpu" or self.packed_weight is not None or self.lora is not None
                or self.quantized is not None):
            return list(self(x).split(self.output_sizes_per_partition, dim=-1))
        weights = self.weight.split(self.output_sizes_per_partition, dim=0)
        biases = (self.bias.split(self.output_sizes_per_partition, dim=0)
                  if self.bias is not None else [None] * len(weights))
        return [linear(x, w, b) for w, b in zip(weights, biases, strict=True)]

    def weight_loader(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear shard_id must be an index into "
                             f"{self.output_sizes}, got {shard_id!r}.")
        tp = self.ctx.tp_size
        size = self.output_sizes[shard_id] // tp
        offset = sum(self.output_sizes[:shard_id]) // tp
        shard = loaded_weight.narrow(0, self.ctx.tp_rank * size, size)
        self._place(param.data.narrow(0, offset, size), offset, shard,
                    f"gate_up shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Query heads are split over TP (num_heads/tp
    per rank). KV heads are split too while there are at least as many as ranks; with
    fewer (tp > num_kv_heads, e.g. 2 KV heads at TP=8) each is replicated over
    tp/num_kv_heads ranks, and a rank holds the one KV head its query heads attend with
    (vLLM's rule): rank r's query heads are r*H/tp.., whose KV head is r // (tp/KV)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool, *, ctx: ParallelContext,
                 params_dtype: torch.dtype) -> None:
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, ctx.tp_size, "num_attention_heads")
        if ctx.tp_size >= total_num_kv_heads:
            if ctx.tp_size % total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size={ctx.tp_size} must be a multiple of "
                    f"num_key_value_heads={total_num_kv_heads} to replicate KV heads "
                    "across ranks.")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = ctx.tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, ctx.tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        # Each rank's output columns: its query heads plus its (possibly replicated) KV.
        output_size = (total_num_heads + 2 * self.num_kv_heads * ctx.tp_size) * head_size
        super().__init__(hidden_size, output_size, bias, ctx=ctx, params_dtype=params_dtype)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    def weight_loader(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        if shard_id not in offsets:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}.")
        offset, size = offsets[shard_id]
        shard_index = self.ctx.tp_rank
        if shard_id != "q":
            shard_index //= self.num_kv_head_replicas
        shard = loaded_weight.narrow(0, shard_index * size, size)
        self._place(param.data.narrow(0, offset, size), offset, shard, f"qkv shard {shard_id}")


class RowParallelLinear(PackedLinearWeight, nn.Module):
    """y = x W^T + b with W split along the input dim; partial sums are all-reduced, and
    the bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool, *, ctx: ParallelContext,
                 params_dtype: torch.dtype, reduce_results: bool = True) -> None:
        super().__init__()
        self.ctx = ctx
        self.input_size_per_partition = divide(input_size, ctx.tp_size, "input_size")
        self.output_size = output_size
        self.reduce_results = reduce_results
        self.lora: LinearLoRA | None = None
        self.weight = new_param((output_size, self.input_size_per_partition), ctx, params_dtype)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias = None
        if bias:
            self.bias = new_param((output_size,), ctx, params_dtype)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: replicated
            shard = read_whole(loaded_weight)
            _check_shape(param, shard, type(self).__name__)
            param.data.copy_(shard)
            return
        size = param.shape[1]
        self._place(param.data, 0, loaded_weight.narrow(1, self.ctx.tp_rank * size, size),
                    type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.lora is not None:  # this rank's share, summed by the all-reduce
            self.lora.apply(x, out)
        if self.reduce_results:
            out = tp_all_reduce(out, self.ctx)
        if self.bias is not None:
            out = out + self.bias
        return out


class VocabParallelEmbedding(QuantizableWeight, nn.Module):
    """Embedding with the vocabulary split over TP ranks (each holds ceil(vocab/tp) rows,
    zero-padded). Ids outside this rank's range look up zeros; the all-reduce sums the
    one rank that owns each id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext,
                 params_dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // ctx.tp_size)
        self.vocab_start_index = ctx.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition,
                                   num_embeddings)
        self.weight = new_param((self.num_embeddings_per_partition, embedding_dim), ctx,
                                 params_dtype)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: Weight,
                      shard_id: object = None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {loaded_weight.shape[0]} rows in the checkpoint, "
                             f"vocab_size is {self.num_embeddings}.")
        n = self.vocab_end_index - self.vocab_start_index
        shard = loaded_weight.narrow(0, self.vocab_start_index, n)
        if isinstance(shard, QuantizedShard):
            self._place(param.data, 0, shard.pad_rows(param.shape[0]), type(self).__name__)
            return
        _check_shape(param.data[:n], shard, type(self).__name__)
        param.data[:n].copy_(shard)
        param.data[n:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.rows(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self._lookup(input_ids)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_range
        out = self._lookup(local_ids)
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return tp_all_reduce(out, self.ctx)


class ParallelLMHead(PackedLinearWeight, VocabParallelEmbedding):
    """Output projection sharded like the embedding; ``compute_logits`` returns full-vocab
    logits on every TP rank (all-gather), so every rank samples the same token."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden_states)
        logits = tp_all_gather(logits, self.ctx, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits().")


class PPMissingLayer(nn.Identity):
    """Placeholder for a layer that lives on another pipeline stage."""
