"""The elementwise parts of a decoder layer: the residual add + RMSNorm, and rotary
embedding, each written once with transformers' numerics (normalise in float32, cast back,
then scale; rotate_half).

Eager, each is several kernels (casts, a reduction, products, a concatenation); on a GPU,
where a decode step's time is mostly launches, ``torch.compile`` (inductor) fuses each into
one kernel. Compiled where ``compile_fused_ops`` says (default: on CUDA unless
``enforce_eager``; off on CPU, where the eager ops are already memory-bound loops and a
compile costs seconds per start). Each function is compiled once for every token count
(``dynamic=True``) at the first forward (the memory profile, before any CUDA graph is
captured); inductor keeps what it compiled on disk (its FX graph cache), so a restart
loads it instead of compiling again. A compile that fails (no compiler, an inductor bug)
leaves that function eager, with a warning: the step still runs, at eager speed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add fused in front, as vLLM."""
    x = x + residual
    return rms_norm(x, weight, eps), x


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary(cos: torch.Tensor, sin: torch.Tensor, query: torch.Tensor, key: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D] and key [T, Hkv, D] rotated by cos and sin [T, 1, R]: the first R
    channels of each head (a partial rotary factor), the rest passed through."""
    dim = cos.shape[-1]
    if dim == query.shape[-1]:
        return _rotate(query, cos, sin), _rotate(key, cos, sin)
    return (torch.cat([_rotate(query[..., :dim], cos, sin), query[..., dim:]], dim=-1),
            torch.cat([_rotate(key[..., :dim], cos, sin), key[..., dim:]], dim=-1))


@dataclass(frozen=True)
class FusedOps:
    """The three functions a model's layers call: eager or compiled."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    @property
    def compiled(self) -> bool:
        """Whether all three run compiled (False once one has fallen back to eager)."""
        return all(isinstance(f, _CompiledOrEager) and f.compiled is not None
                   for f in (self.rms_norm, self.add_rms_norm, self.rotary))


EAGER_OPS = FusedOps(rms_norm, add_rms_norm, rotary)


class _CompiledOrEager:
    """``fn`` through torch.compile, or ``fn`` itself from the first call whose compiled
    form raised."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.compiled: Callable | None = torch.compile(fn, dynamic=True, fullgraph=True)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compile failure: run eager
                logger.warning("torch.compile of %s failed, it runs eagerly: %r",
                               self.fn.__name__, e)
                self.compiled = None
        return self.fn(*args)


def compiled_ops() -> FusedOps:
    """The same functions through torch.compile (compiled at their first call)."""
    return FusedOps(_CompiledOrEager(rms_norm), _CompiledOrEager(add_rms_norm),
                    _CompiledOrEager(rotary))


def resolve_fused_ops(compile_fused_ops: bool | None, device: torch.device,
                      enforce_eager: bool) -> FusedOps:
    """``compile_fused_ops`` None: compiled on CUDA unless ``enforce_eager``."""
    if compile_fused_ops is None:
        compile_fused_ops = device.type == "cuda" and not enforce_eager
    return compiled_ops() if compile_fused_ops else EAGER_OPS
