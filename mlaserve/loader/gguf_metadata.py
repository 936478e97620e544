"""Parse a GGUF file's header (metadata and tensor table) without touching the tensor data.

`gguf.GGUFReader` builds one numpy view per array element, which costs about 3.6 s on SmolLM2's
98k-string vocabulary + merges; reading the same bytes with `struct` takes a fraction of that. The `gguf`
package still supplies the format constants and, in `gguf_reader`, the dequantization kernels.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; llama.cpp stopped writing it in 2023

# struct codes of the fixed-width value types; STRING and ARRAY are variable-length and handled apart
_SCALAR_CODES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: GGUF lists the fastest-moving dimension first
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def tensor_names(self) -> set[str]:
        return {info.name for info in self.tensors}


class _Cursor:
    """A read position over the mapped file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        start, self.pos = self.pos, self.pos + length
        return self.buf[start : self.pos].decode("utf-8")

    def value(self, value_type: int) -> Any:
        kind = GGUFValueType(value_type)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_type, count = self.unpack("IQ")
            item_kind = GGUFValueType(item_type)
            if item_kind == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if item_kind in _SCALAR_CODES:
                return [_clean(item_kind, v) for v in self.unpack(f"{count}{_SCALAR_CODES[item_kind]}")]
            return [self.value(item_type) for _ in range(count)]  # nested arrays: rare, so no fast path
        return _clean(kind, self.unpack(_SCALAR_CODES[kind])[0])


def _clean(kind: GGUFValueType, value: Any) -> Any:
    # A float32 such as 1e-5 would otherwise surface as 9.999999747378752e-06, unlike the config.json it
    # came from; the shortest float32 repr gives the number the model author wrote.
    if kind == GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))
    return value


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata dict and the tensor table of a GGUF file (v2/v3)."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes {_MAGIC!r})")
        cursor = _Cursor(buf)
        cursor.pos = 4
        version, tensor_count, kv_count = cursor.unpack("IQQ")
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{path} is GGUF version {version}; supported versions: {_SUPPORTED_VERSIONS}")

        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            (value_type,) = cursor.unpack("I")
            metadata[key] = cursor.value(value_type)

        raw_tensors = []
        for _ in range(tensor_count):
            name = cursor.string()
            (n_dims,) = cursor.unpack("I")
            dims = cursor.unpack(f"{n_dims}Q")
            ggml_type, offset = cursor.unpack("IQ")
            raw_tensors.append((name, tuple(reversed(dims)), GGMLQuantizationType(ggml_type), offset))

        # tensor offsets count from the data section, which starts at the next alignment boundary
        alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        tensors = tuple(
            GGUFTensorInfo(name, shape, ggml_type, data_start + offset, _nbytes(shape, ggml_type))
            for name, shape, ggml_type, offset in raw_tensors
        )
    if "general.architecture" not in metadata:
        raise ValueError(f"{path} has no general.architecture in its metadata")
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)


def _nbytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return prod(shape) // block_size * type_size
