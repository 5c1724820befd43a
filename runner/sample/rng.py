"""Stateless, counter-based random numbers for sampling.

The uniform for vocabulary entry ``v`` at sequence position ``p`` of a request with seed
``s`` is a pure hash of ``(s, p, v)``: nothing advances, so a request draws the same token
alone or in any batch, at any timing and parallelism. The hash (a 32-bit xor-shift-multiply
mixer) is evaluated so that no product overflows and the same integers come out on every
device.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MUL = 0x045D9F3B  # < 2**27: (2**32 - 1) * _MUL fits in int64
_GOLDEN = 0x9E3779B1
_SEED_SALT = 0x3C6EF372


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective avalanche mix of 32-bit values held in an int64 tensor (in place)."""
    x ^= x >> 16
    x.mul_(_MUL).bitwise_and_(_MASK32)
    x ^= x >> 16
    x.mul_(_MUL).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def to_int64_seed(seed: int) -> int:
    """Any Python int as the int64 with the same low 64 bits (what a tensor can hold)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from int64 ``seeds`` and ``positions`` [B]."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    h = _mix32((lo + _SEED_SALT) & _MASK32)
    h = _mix32(h ^ hi)
    return _mix32(h ^ (positions & _MASK32))


def vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """One 32-bit key per vocabulary entry [V] (cache it: it never changes)."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _mix32((ids * _GOLDEN) & _MASK32)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """``_mix32`` on int32 tensors holding the same 32 bits (in place): half the memory
    traffic of int64 on the [B, V] noise, which is most of a sampled step's host work at a
    large vocabulary. Products wrap modulo 2**32 as the int64 form's mask does; shifts on
    int32 are arithmetic, so each one is masked back to a logical shift."""
    t = torch.bitwise_right_shift(x, 16).bitwise_and_(0xFFFF)
    x ^= t
    x.mul_(_MUL)
    x ^= torch.bitwise_right_shift(x, 16, out=t).bitwise_and_(0xFFFF)
    x.mul_(_MUL)
    x ^= torch.bitwise_right_shift(x, 16, out=t).bitwise_and_(0xFFFF)
    return x


def uniform(row_key: torch.Tensor, vocab_key: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float32 [B, V]: 24 hash bits, offset by half a step. The keys
    (int64 below 2**32) are cast to int32, which keeps their 32 bits."""
    x = _mix32_int32(row_key.to(torch.int32)[:, None] ^ vocab_key.to(torch.int32)[None, :])
    bits = x.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(row_key: torch.Tensor, vocab_key: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [B, V]: argmax(logits + noise) samples softmax(logits)."""
    u = uniform(row_key, vocab_key)
    return u.log_().neg_().log_().neg_()
