"""A GGUF file's metadata and tensors, memory-mapped.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, so the built-in model's
vocabulary (49,152 tokens and 48,900 merges) took 7.5 s of a 12 s load (cProfile). This parses the same
layout (GGUF v2/v3: header, key/values, tensor infos, aligned data) with `struct` in well under a second;
the `gguf` package still supplies the type tables and the dequantization. Tensor data are exposed as
`GGUFReader` exposes them: float and integer types as their numpy dtype in numpy order, block types (and
BF16) as uint8 rows of their bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_ELEMENT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # as stored: innermost dimension first
    data: np.ndarray  # memory-mapped; numpy order
    offset: int  # of its first byte in the file


class GGUFFile:
    """`metadata` (key -> Python value; arrays as lists) and `tensors` of one GGUF file. Raises ValueError
    on a malformed file."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            if self._read(4) != b"GGUF":
                raise ValueError("no GGUF magic number")
            version, n_tensors, n_kv = self._unpack("<IQQ")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (readable: 2, 3)")
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._string()
                self.metadata[key] = self._value(GGUFValueType(self._unpack("<I")[0]))
            infos = [self._tensor_info() for _ in range(n_tensors)]
            size = len(self._buf)
        finally:
            self._buf.close()
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(path, size, start, *info) for info in infos]

    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            raise ValueError(f"truncated at byte {self._pos} (wanted {n} more)")
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._buf):
            raise ValueError(f"truncated at byte {self._pos}")
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return out

    def _string(self) -> str:
        return self._read(self._unpack("<Q")[0]).decode("utf-8", errors="replace")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = GGUFValueType(self._unpack("<I")[0]), self._unpack("<Q")[0]
        if item in _SCALARS:  # numbers in one read
            fmt = "<" + _SCALARS[item]
            size = struct.calcsize(fmt) * count
            return np.frombuffer(self._read(size), dtype=np.dtype(fmt)).tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, np.ndarray, GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._unpack("<I")[0]
        dims = np.array(self._unpack(f"<{n_dims}Q"), dtype=np.uint64)
        kind, offset = self._unpack("<IQ")
        return name, dims, GGMLQuantizationType(kind), offset

    @staticmethod
    def _tensor(path: str | Path, file_size: int, start: int, name: str, dims: np.ndarray,
                kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        """The tensor's own mapping of its bytes, copy-on-write: a tensor kept quantized is a view of the
        file's pages (writable, so torch takes it without a copy), and once the load drops the tensors a
        model did not keep (repacked, dequantized), their pages leave the process with them."""
        shape = tuple(reversed(dims.tolist()))
        n_elements = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * size // block
        begin = start + offset
        if begin + n_bytes > file_size:
            raise ValueError(f"tensor {name} runs past the end of the file")
        raw = np.memmap(path, mode="c", offset=begin, shape=(n_bytes,)) if n_bytes else np.empty(0, np.uint8)
        if kind in _ELEMENT_TYPES:
            array = raw.view(_ELEMENT_TYPES[kind]).reshape(shape)
        else:
            if shape[-1] % block:
                raise ValueError(f"tensor {name}: a row of {shape[-1]} is not whole {kind.name} blocks of {block}")
            array = raw.reshape(*shape[:-1], shape[-1] // block * size)  # rows of block bytes
        return GGUFTensor(name, kind, dims, array, begin)
