"""GGUF's block formats decoded into codes, scales and zeros per group of 32 (never into
floats): Q4_0, Q4_1 and Q4_K as 4-bit codes; Q8_0, and Q5_0, Q5_1 and Q5_K (5-bit codes
0..31, held in the kernel's 8-bit form), as 8-bit; Q6_K as 8-bit codes q - 32 with a scale
per group of 16 (its own scale granularity: exact); other types (Q2_K, Q3_K) have no group
form here and are dequantized by the loader.

Block layouts (llama.cpp's ggml-common.h): Q4_0 = fp16 d, 16 bytes of nibbles (element i
in the low nibble of byte i, element i+16 in the high), w = d (q - 8); Q4_1 = fp16 d, fp16
m, the same nibbles, w = d q + m; Q8_0 = fp16 d, 32 int8, w = d q; Q4_K = a super-block of
256: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles (each
64 elements: the low nibbles of 32 bytes, then their high nibbles), w = d sc q - dmin m. Q5_0 = fp16 d, 4 bytes qh (bit i: element i's fifth bit), the Q4_0
nibbles, w = d (q - 16); Q5_1 = fp16 d, fp16 m, qh, nibbles, w = d q + m; Q5_K = Q4_K's
header and scales, 32 bytes qh (for the super-block's j-th 32 elements, bit j of byte l is
element l's fifth bit), then Q4_K's nibbles, w = d sc q - dmin m. Q6_K = a super-block of
256: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 elements), fp16 d; each half of
128 elements reads 64 bytes of ql and 32 of qh: element 32i + l (i = 0..3, l = 0..31) has
the low nibble of ql[l] (i = 0), ql[l + 32] (i = 1), the high nibble of ql[l] (i = 2) or
ql[l + 32] (i = 3), and bits 2i, 2i+1 of qh[l] as its top two bits; w = d sc (q - 32).
d sc is exact in float32 (11 x 8 significant bits), so scale x code is the same float
product the reference dequantization computes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raylm.runner.quantization.group_quantized import GroupQuantized

GROUP_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"})
# codes in the kernel's 8-bit form
_EIGHT_BIT = frozenset({"Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"})


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, 12] packed bytes -> ([B, 8] scales, [B, 8] mins), 6 bits each."""
    s = scales.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, 128] bytes of a K super-block -> [B, 256] codes: per 64 elements, the low
    nibbles of 32 bytes, then their high nibbles."""
    qs = qs.reshape(-1, 4, 32)
    return np.stack([qs & 15, qs >> 4], axis=2).reshape(qs.shape[0], 256)


def _k_quantized(codes: np.ndarray, super_blocks: np.ndarray, groups: tuple[int, int],
                 bits: int, kind: str) -> GroupQuantized:
    """Codes with a K super-block's scales (d x 6-bit scale) and zeros (-dmin x 6-bit min)
    per group of 32."""
    d, dmin = _f16(super_blocks[:, 0:2]), _f16(super_blocks[:, 2:4])
    sc, mn = _q4_k_scales(super_blocks[:, 4:16])
    return GroupQuantized(torch.from_numpy(np.ascontiguousarray(codes)),
                          torch.from_numpy(np.ascontiguousarray((d * sc).reshape(groups))),
                          torch.from_numpy(np.ascontiguousarray((-(dmin * mn)).reshape(groups))),
                          bits, kind)


def _q6_k(raw: np.ndarray, shape: tuple[int, int]) -> GroupQuantized:
    """Q6_K super-blocks -> int8 codes q - 32, scale d x sc per 16, zero 0."""
    n, k = shape
    blocks = raw.reshape(n * (k // 256), 210)
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [B, half, which 32 bytes, l]
    low = np.concatenate([ql & 15, ql >> 4], axis=2)  # [B, half, i, l]
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[None, None, :, None]
    top = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    codes = ((low | (top << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    scale = (_f16(blocks[:, 208:210]) * sc).reshape(n, k // 16)
    return GroupQuantized(torch.from_numpy(np.ascontiguousarray(codes)),
                          torch.from_numpy(np.ascontiguousarray(scale)),
                          torch.zeros(n, k // 16), 8, "Q6_K", group_size=16)


def decode_group_blocks(kind: str, data: np.ndarray, shape: tuple[int, int]) -> GroupQuantized:
    """The [N, K] weight in ``data`` (GGUF's raw bytes, [N, bytes per row]) as codes with
    a scale and zero per group of 32 (Q6_K: 16)."""
    n, k = shape
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    g = k // 32
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        width = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
        blocks = raw.reshape(n, g, width)
        d = _f16(blocks[..., 0:2]).reshape(n, g)
        if kind == "Q8_0":
            codes = blocks[..., 2:].view(np.int8).reshape(n, k)
            zero = np.zeros_like(d)
            bits = 8
        else:
            head = 4 if kind == "Q4_1" else 2
            codes = _nibbles(blocks[..., head:]).reshape(n, k)
            zero = _f16(blocks[..., 2:4]).reshape(n, g) if kind == "Q4_1" else -8.0 * d
            bits = 4
        return GroupQuantized(torch.from_numpy(np.ascontiguousarray(codes)),
                              torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(zero)),
                              bits, kind)
    if kind in ("Q5_0", "Q5_1"):
        head = 8 if kind == "Q5_1" else 6  # d (and m), then 4 bytes of fifth bits
        blocks = raw.reshape(n, g, head + 16)
        d = _f16(blocks[..., 0:2]).reshape(n, g)
        qh = np.ascontiguousarray(blocks[..., head - 4:head]).view("<u4")  # [n, g, 1]
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [n, g, 32]
        fives = (_nibbles(blocks[..., head:]) | (high << 4).astype(np.uint8)).reshape(n, k)
        zero = _f16(blocks[..., 2:4]).reshape(n, g) if kind == "Q5_1" else -16.0 * d
        return GroupQuantized(torch.from_numpy(fives.astype(np.int8)), torch.from_numpy(d),
                              torch.from_numpy(np.ascontiguousarray(zero)), 8, kind)
    if kind == "Q5_K":
        super_blocks = raw.reshape(n * (k // 256), 176)
        qh = super_blocks[:, 16:48]  # [B, 32]
        low = _k_nibbles(super_blocks[:, 48:]).reshape(-1, 8, 32)  # the j-th 32 elements
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        codes = (low | (high << 4)).reshape(n, k).astype(np.int8)
        return _k_quantized(codes, super_blocks, (n, g), 8, kind)
    if kind == "Q6_K":
        return _q6_k(raw, shape)
    if kind == "Q4_K":
        super_blocks = raw.reshape(n * (k // 256), 144)
        return _k_quantized(_k_nibbles(super_blocks[:, 16:]).reshape(n, k), super_blocks,
                            (n, g), 4, kind)
    raise ValueError(f"GGUF type {kind!r} has no group form; one of {sorted(GROUP_FORMATS)}.")


def lazy_tensor(tensor: Any, counter: list[int] | None = None) -> LazyGGUFBlocks:
    """A gguf ReaderTensor of a group format, to be read and decoded as narrowed
    (``tensor.shape`` is innermost first, as GGUF lists dims)."""
    k, n = (int(x) for x in tensor.shape)
    return LazyGGUFBlocks(tensor.data, tensor.tensor_type.name, (n, k), counter=counter)


_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
          "Q5_0": (32, 22), "Q5_1": (32, 24), "Q5_K": (256, 176), "Q6_K": (256, 210)}


class LazyGGUFBlocks:
    """A GGUF tensor of a group format, not read yet: the rows and columns a TP rank's
    loader narrows out are all that ``decode`` reads from the memory-mapped file (whole
    blocks: a column range that cuts a Q4_K super-block of 256 reads the super-blocks it
    touches). ``read_bytes`` counts what the decodes read."""

    def __init__(self, data: np.ndarray, kind: str, shape: tuple[int, int],
                 rows: np.ndarray | None = None, columns: tuple[int, int] | None = None,
                 counter: list[int] | None = None) -> None:
        if kind not in _BLOCK:
            raise ValueError(f"GGUF type {kind!r} has no group form; one of "
                             f"{sorted(GROUP_FORMATS)}.")
        self.data, self.kind, self.file_shape = data, kind, shape
        self.rows = np.arange(shape[0]) if rows is None else rows
        self.columns = (0, shape[1]) if columns is None else columns
        self.read_bytes = counter if counter is not None else [0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.rows), self.columns[1] - self.columns[0]))

    @property
    def bits(self) -> int:
        return 8 if self.kind in _EIGHT_BIT else 4

    def _with(self, rows: np.ndarray, columns: tuple[int, int]) -> LazyGGUFBlocks:
        return LazyGGUFBlocks(self.data, self.kind, self.file_shape, rows, columns,
                              self.read_bytes)

    def narrow(self, dim: int, start: int, length: int) -> LazyGGUFBlocks:
        if dim == 0:
            return self._with(self.rows[start:start + length], self.columns)
        if start % 32 or length % 32:
            raise ValueError(f"a {self.kind} weight splits its input features in groups of "
                             f"32; columns [{start}, {start + length}) cut one.")
        first = self.columns[0] + start
        return self._with(self.rows, (first, first + length))

    def covering_columns(self, start: int, end: int) -> tuple[int, int]:
        """The smallest range of whole groups of 32 around file columns [start, end) (a
        dense load's split may cut a group; it reads the groups it touches)."""
        return start // 32 * 32, min(-(-end // 32) * 32, self.file_shape[1])

    def select_rows(self, index: torch.Tensor) -> LazyGGUFBlocks:
        return self._with(self.rows[index.numpy()], self.columns)

    def decode(self) -> GroupQuantized:
        """Read and decode the selected rows and columns."""
        width, nbytes = _BLOCK[self.kind]
        first, last = self.columns[0] // width, -(-self.columns[1] // width)
        raw = np.asarray(self.data).reshape(self.file_shape[0], -1)
        raw = raw[self.rows, first * nbytes:last * nbytes]
        self.read_bytes[0] += raw.size
        blocks = decode_group_blocks(self.kind, raw, (len(self.rows), (last - first) * width))
        cut = self.columns[0] - first * width
        if cut or blocks.shape[1] != self.shape[1]:
            blocks = blocks.narrow(1, cut, self.shape[1])
        return blocks

    def pad_rows(self, rows: int) -> GroupQuantized:
        return self.decode().pad_rows(rows)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.decode().dequantize(dtype)

    def nbytes(self) -> int:
        """Bytes the whole tensor holds in the file."""
        width, nbytes = _BLOCK[self.kind]
        return self.file_shape[0] * self.file_shape[1] // width * nbytes
