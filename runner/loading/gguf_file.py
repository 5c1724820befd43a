"""A GGUF file's metadata and tensor index, read in one pass; the tensors memory-mapped.

``gguf.GGUFReader`` makes a numpy view per metadata item: a tokenizer of 262k tokens (Gemma 3)
costs it some 20 seconds on this project's CPU machines, and a checkpoint is opened by the
config reader and again by every rank's loader. Here the metadata is parsed from the bytes
with ``struct`` (string arrays in a plain loop, numeric arrays as one ``frombuffer``) and
each tensor's data is a view of one file-wide memory map, laid out as ``GGUFReader`` lays it
out (the gguf package's dequantizers take it as they take its own).
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (the format's numbering): struct code of each scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` innermost first (as GGUF lists dims), ``data`` its bytes as
    ``GGUFReader`` gives them (elements for plain types, ``uint8`` rows of blocks for the
    quantized ones)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.off, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.off)[0]
        self.off += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        raw = bytes(self.buf[self.off:self.off + n])
        self.off += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS and item != 7:
                dtype = np.dtype("<" + _SCALARS[item])
                out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.off)
                self.off += count * dtype.itemsize
                return out.tolist()
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"GGUF file {self.path!r}: unknown metadata value type {kind}.")


class GGUFFile:
    """``fields``: metadata key -> Python value (lists for arrays); ``tensors`` in file
    order. A ValueError names a file that is not GGUF (or not little-endian v2/v3)."""

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map.data), path)
        if bytes(self._map[:4]) != MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (no GGUF magic).")
        cur.off = 4
        version = cur.take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF file {path!r}: version {version} is not supported "
                             "(2 and 3 are, little-endian).")
        num_tensors, num_fields = cur.take("Q"), cur.take("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cur.string()
            self.fields[key] = cur.value(cur.take("I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
            infos.append((name, dims, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.off // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            np_dims = tuple(reversed(dims))
            n = int(np.prod(dims))
            plain = _PLAIN_DTYPES.get(kind.name)
            if plain is not None:
                dtype, count = np.dtype(plain), n
            else:
                block, size = GGML_QUANT_SIZES[kind]
                dtype, count = np.dtype(np.uint8), n * size // block
                np_dims = quant_shape_to_byte_shape(np_dims, kind)
            begin = start + offset
            end = begin + count * dtype.itemsize
            if end > self._map.size:
                raise ValueError(f"GGUF file {path!r}: tensor {name!r} runs past the end "
                                 "of the file (truncated?).")
            data = self._map[begin:end].view(dtype).reshape(np_dims)
            self.tensors.append(GGUFTensor(name, kind, dims, data))


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed file, shared within a process while it is unchanged (the config reader
    and an in-process rank's loader open the same file)."""
    st = os.stat(path)
    return _open(os.path.abspath(path), st.st_size, st.st_mtime_ns)
