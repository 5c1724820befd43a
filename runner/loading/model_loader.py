"""Build a model for one rank and fill it from a Hugging Face folder's safetensors or a GGUF file.

Safetensors tensors reach the weight loaders as ``LazyTensor``s, so each TP rank reads
only its shards (about 1/TP of the sharded weights), not every whole tensor; so do the
quantized linears kept quantized (GPTQ, AWQ, FP8: runner/quantization/lazy_shard.py; a GGUF
file's group types: gguf_blocks.LazyGGUFBlocks), and the same dequantized
(``quantization="none"``). A GGUF file's other types (F32 norms, F16, Q2_K, Q3_K) are read
whole."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import process_weights_after_loading
from raylm.runner.attention.cpu_kernel import load_cpu_attention_kernel
from raylm.runner.loading.default_model import ensure_local_model
from raylm.runner.loading.gguf_checkpoint import find_gguf_file, iterate_gguf_weights
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.fused_ops import resolve_fused_ops
from raylm.runner.models.registry import get_model_class
from raylm.runner.quantization.gguf_blocks import LazyGGUFBlocks
from raylm.runner.quantization.gptq_awq import combine_quantized_linears
from raylm.runner.quantization.lazy_shard import Dequantizing, LazyQuantizedShard
from raylm.runner.quantization.linear_kernel import load_quantized_linear_kernel
from raylm.runner.quantization.quantize_model import (
    log_weight_paths,
    pack_quantized_weights,
    triton_runs_quantized,
)
from raylm.scheduler.config import envs
from raylm.scheduler.config.checkpoint_quantization import checkpoint_quantization
from raylm.scheduler.config.engine_config import DTYPES, ModelConfig

if TYPE_CHECKING:
    from raylm.runner.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def cpu_has_fast_bfloat16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """AVX512-BF16 or AMX-BF16 in the CPU flags: oneDNN then runs bf16 matmuls natively
    (vLLM-CPU's test for defaulting to bf16)."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def checkpoint_dtype(hf_config: dict) -> torch.dtype:
    """The dtype config.json declares (``dtype``, or the older ``torch_dtype``); float32
    when it declares none."""
    name = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    name = name.removeprefix("torch.")
    return getattr(torch, name) if name in DTYPES and name != "auto" else torch.float32


def resolve_dtype(dtype: str, device: torch.device, hf_config: dict | None = None,
                  fast_cpu_bfloat16: bool | None = None) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype, except that a float32 checkpoint runs in
    bfloat16 on CUDA, and on a CPU with native bf16 (AVX512-BF16 / AMX) unless
    RAYLM_CPU_AUTO_BFLOAT16=0 (vLLM-CPU does the same downcast); every other name of DTYPES
    is torch's own."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
    if dtype == "auto":
        ckpt = checkpoint_dtype(hf_config or {})
        if ckpt != torch.float32:
            return ckpt
        if device.type == "cuda":
            return torch.bfloat16
        if fast_cpu_bfloat16 is None:
            fast_cpu_bfloat16 = envs.cpu_auto_bfloat16() and cpu_has_fast_bfloat16()
        return torch.bfloat16 if fast_cpu_bfloat16 else torch.float32
    return getattr(torch, dtype)


def safetensors_files(model_dir: str) -> list[str]:
    """The shards named by model.safetensors.index.json if present, else every *.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in files]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model {model_dir!r} has no *.safetensors files.")
    return files


@dataclass
class WeightReadStats:
    """What one load read from the checkpoint, for logs and tests: ``bytes_read`` counts
    the tensor data taken out of the files (a ``LazyTensor.narrow`` or ``region`` its slice,
    a whole read the tensor; a GGUF tensor of a group type the blocks its rank narrows out,
    kept quantized or dequantized, one of another type its dequantized whole),
    ``bytes_loaded`` the whole size
    of every tensor handed to the model (what reading each whole would cost)."""

    bytes_read: int = 0
    bytes_loaded: int = 0
    tensors: int = 0


def _safetensors_dtypes() -> dict[str, torch.dtype]:
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
             "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
             "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
             "F8_E8M0": "float8_e8m0fnu"}
    return {code: getattr(torch, name) for code, name in names.items() if hasattr(torch, name)}


_SAFETENSORS_DTYPES = _safetensors_dtypes()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class LazyTensor:
    """A safetensors tensor not read yet (``safe_open(...).get_slice``). ``shape``,
    ``dim()`` and ``dtype`` come from the file header; ``narrow(dim, start, length)``
    reads just that range, as a contiguous tensor in the checkpoint's dtype, and
    ``read()`` the whole tensor. The weight loaders (parallel/layers.py) take it and a
    ``torch.Tensor`` alike: they narrow out their shard, and read whole
    (``parallel.layers.read_whole``) what every rank keeps entire, so each TP rank reads
    about 1/TP of the sharded weights. Each read is added to ``stats``."""

    def __init__(self, handle: Any, name: str, stats: WeightReadStats | None = None) -> None:
        self._handle = handle
        self.name = name
        self.shape = torch.Size(handle.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(handle.get_dtype())
        self._stats = stats

    def dim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """The whole tensor's size in bytes (from the header; nothing is read)."""
        if self.dtype is None:
            raise ValueError(f"{self.name}: torch has no dtype for safetensors' "
                             f"{self._handle.get_dtype()!r}.")
        return self.shape.numel() * self.dtype.itemsize

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        if self._stats is not None:
            self._stats.bytes_read += _nbytes(t)
        return t

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Indices ``start .. start + length`` of ``dim``, as ``torch.Tensor.narrow`` would
        give them but contiguous, and taken from the file alone: the rest of the tensor is
        never read (with safetensors' mmap backend the result may map the file's pages,
        which are read from disk when first touched: by the copy into the parameter)."""
        ndim = self.dim()
        if not -ndim <= dim < ndim:
            raise IndexError(f"{self.name}: dim {dim} is out of range for shape "
                             f"{tuple(self.shape)}.")
        dim %= ndim
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"{self.name}: rows {start}..{start + length} of dim {dim} are "
                             f"outside its shape {tuple(self.shape)}.")
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._count(self._handle[index].contiguous())

    def region(self, *ranges: tuple[int, int]) -> torch.Tensor:
        """Indices ``start .. stop`` of each leading dim (the rest whole), contiguous and
        read from the file alone: a quantized shard's block of a packed tensor
        (runner/quantization/lazy_shard.py)."""
        if not ranges:
            return self.read()
        if len(ranges) > self.dim():
            raise IndexError(f"{self.name}: {len(ranges)} ranges for shape "
                             f"{tuple(self.shape)}.")
        for d, (start, stop) in enumerate(ranges):
            if not 0 <= start <= stop <= self.shape[d]:
                raise ValueError(f"{self.name}: rows {start}..{stop} of dim {d} are outside "
                                 f"its shape {tuple(self.shape)}.")
        index = tuple(slice(start, stop) for start, stop in ranges)
        return self._count(self._handle[index].contiguous())

    def read(self) -> torch.Tensor:
        """The whole tensor."""
        return self._count(self._handle[:] if self.dim() else self._handle[...])

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def iterate_weights(model_dir: str, wanted: Callable[[str], bool] | None = None,
                    stats: WeightReadStats | None = None) -> Iterator[tuple[str, LazyTensor]]:
    """(name, LazyTensor) for each tensor ``wanted`` accepts; the others are never read,
    and of these only what the model's loaders narrow out or read whole (``stats``, when
    given, counts it)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if wanted is None or wanted(name):
                    tensor = LazyTensor(f.get_slice(name), name, stats)
                    if stats is not None:
                        stats.tensors += 1
                        if tensor.dtype is not None:  # sub-byte types: no whole size
                            stats.bytes_loaded += tensor.nbytes
                    yield name, tensor


def _count_whole(weights: Iterable[tuple[str, torch.Tensor | LazyGGUFBlocks]],
                 stats: WeightReadStats | None
                 ) -> Iterator[tuple[str, torch.Tensor | LazyGGUFBlocks]]:
    """``weights`` (real tensors, already read whole, or quantized ones not read yet), each
    counted in ``stats`` (a quantized one's bytes read are counted as they are read)."""
    for name, tensor in weights:
        if stats is not None:
            stats.tensors += 1
            if isinstance(tensor, LazyGGUFBlocks):
                stats.bytes_loaded += tensor.nbytes()
            else:
                stats.bytes_loaded += _nbytes(tensor)
                stats.bytes_read += _nbytes(tensor)
        yield name, tensor


def keeps_quantized(quantization: str | None, device: torch.device) -> bool:
    """Whether a quantized checkpoint's weights (a GGUF file's group formats, GPTQ, AWQ,
    FP8) stay quantized: by default on CPU where the C++ kernel builds and on CUDA (the Triton
    kernel); ``quantization="none"`` dequantizes them at load. With RAYLM_QUANT_BACKEND=
    native, CUDA dequantizes them and asking for a method there is refused."""
    if quantization == "none":
        return False
    if triton_runs_quantized(device):
        return True
    if device.type != "cpu":
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} runs on CPU only; {device} "
                             "would dequantize the weights (pass quantization='none').")
        return False
    if load_quantized_linear_kernel():
        return True
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r}: the quantized-linear kernel could "
                         "not be built on this machine (see the warning above).")
    return False


def _dequantized(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Quantized linears (and a GGUF file's group-format tensors) as lazy dense tensors:
    each rank dequantizes only what it reads."""
    for name, tensor in weights:
        yield name, (Dequantizing(tensor)
                     if isinstance(tensor, LazyQuantizedShard | LazyGGUFBlocks) else tensor)


def get_model(model_config: ModelConfig, ctx: ParallelContext,
              stats: WeightReadStats | None = None) -> LlamaForCausalLM:
    """The model for ``ctx``'s stage and TP shard, weights loaded, in eval mode. What the
    load read is logged, and added to ``stats`` when given."""
    ensure_local_model(model_config.model)  # a rank on a node that has not fetched it yet
    cfg = DecoderConfig.from_hf(model_config.hf_config)
    dtype = resolve_dtype(model_config.dtype, ctx.device, model_config.hf_config)
    # Every architecture is LlamaForCausalLM (registry.py).
    model_cls = cast("type[LlamaForCausalLM]",
                     get_model_class(model_config.hf_config.get("architectures") or []))
    max_position = max(cfg.max_position_embeddings, model_config.max_model_len)
    ops = resolve_fused_ops(model_config.compile_fused_ops, ctx.device,
                            model_config.enforce_eager)
    model = model_cls(cfg, ctx, dtype, max_position, ops)
    stats = stats if stats is not None else WeightReadStats()
    gguf_path = find_gguf_file(model_config.model)
    quantized_read = [0]  # bytes of quantized tensors read, as the loaders narrow them
    if gguf_path is not None:
        # Group-format tensors come unread either way; dequantized, each rank reads and
        # dequantizes only its part.
        gguf_weights = _count_whole(iterate_gguf_weights(
            gguf_path, model_config.hf_config, wanted=model.needs_weight,
            keep_quantized=True, read_counter=quantized_read), stats)
        if not keeps_quantized(model_config.quantization, ctx.device):
            gguf_weights = _dequantized(gguf_weights)
        model.load_weights(gguf_weights)
    else:
        weights: Iterable[tuple[str, Any]] = combine_quantized_linears(
            iterate_weights(model_config.model, wanted=model.needs_weight, stats=stats),
            model_config.hf_config)
        if checkpoint_quantization(model_config.hf_config) and not keeps_quantized(
                model_config.quantization, ctx.device):
            weights = _dequantized(weights)
        model.load_weights(weights)
    paths = pack_quantized_weights(model)  # reads what the loaders kept quantized
    stats.bytes_read += quantized_read[0]
    logger.info("tp rank %d/%d, pp rank %d/%d: read %.1f MiB of weights for %d tensors "
                "(%.1f MiB whole)", ctx.tp_rank, ctx.tp_size, ctx.pp_rank, ctx.pp_size,
                stats.bytes_read / 2**20, stats.tensors, stats.bytes_loaded / 2**20)
    log_weight_paths(paths, f"tp rank {ctx.tp_rank}, pp rank {ctx.pp_rank}")
    process_weights_after_loading(model, envs.cpu_pack_linears())
    if ctx.device.type == "cpu":
        load_cpu_attention_kernel()  # built now (first use on this machine), not mid-step
    return model.eval()
