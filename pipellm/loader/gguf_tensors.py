"""A GGUF file's tensors without its metadata: what a pipeline stage needs to load its weights.

gguf.GGUFReader parses every metadata value into numpy views, the vocabulary included (about
a million small arrays for a 49k-token vocabulary: ~1 s and tens of MB that stay resident while
the reader lives). A stage reads only tensors, so this skips the metadata by its length fields
and maps the file read-only: a stage's resident memory then holds the pages of its own tensors
while it copies them, and none of the file once the map is dropped (GGUF layout:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import gguf
import numpy as np

_MAGIC = b"GGUF"
# Fixed-size metadata value types (gguf.GGUFValueType) -> bytes per value.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_ALIGNMENT_KEY = "general.alignment"
# Unquantized types the reader shows as typed arrays; the others are bytes, [rows, row bytes].
_PLAIN_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the file's index describes it."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the innermost (row) dimension first
    offset: int  # from the start of the file
    n_bytes: int


def read_tensor_index(path: Path) -> list[TensorEntry]:
    """The file's tensors, from its header only (no tensor byte is read)."""
    with open(path, "rb") as file:
        if file.read(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic at its start)")
        version, n_tensors, n_kv = struct.unpack("<IQQ", file.read(20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = _read_string(file)
            (value_type,) = struct.unpack("<I", file.read(4))
            if key == _ALIGNMENT_KEY and value_type == _UINT32:
                (alignment,) = struct.unpack("<I", file.read(4))
            else:
                _skip_value(file, value_type)
        raw = []
        for _ in range(n_tensors):
            name = _read_string(file)
            (n_dims,) = struct.unpack("<I", file.read(4))
            shape = struct.unpack(f"<{n_dims}Q", file.read(8 * n_dims))
            tensor_type, offset = struct.unpack("<IQ", file.read(12))
            raw.append((name, gguf.GGMLQuantizationType(tensor_type), shape, offset))
        data_start = -(-file.tell() // alignment) * alignment
    entries = []
    for name, tensor_type, shape, offset in raw:
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        n_bytes = int(np.prod(shape)) * block_bytes // block_values
        entries.append(TensorEntry(name, tensor_type, tuple(shape), data_start + offset, n_bytes))
    return entries


def map_tensors(path: Path) -> list[gguf.ReaderTensor]:
    """The file's tensors as GGUFReader gives them (data: read-only views of a memory map of
    the file), without parsing its metadata. The map is unmapped once no view is left."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    tensors = []
    for entry in read_tensor_index(path):
        dims = tuple(reversed(entry.shape))  # numpy order: rows first
        raw = mapped[entry.offset : entry.offset + entry.n_bytes]
        dtype = _PLAIN_DTYPES.get(entry.tensor_type)
        if dtype is not None:
            data = raw.view(dtype).reshape(dims)
        else:
            data = raw.reshape(gguf.quant_shape_to_byte_shape(dims, entry.tensor_type))
        n_elements = int(np.prod(entry.shape))
        tensors.append(
            gguf.ReaderTensor(
                name=entry.name,
                tensor_type=entry.tensor_type,
                shape=np.array(entry.shape, dtype=np.uint64),
                n_elements=n_elements,
                n_bytes=entry.n_bytes,
                data_offset=entry.offset,
                data=data,
                field=None,
            )
        )
    return tensors


def _read_string(file: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", file.read(8))
    return file.read(length).decode("utf-8", errors="replace")


def _skip_value(file: BinaryIO, value_type: int) -> None:
    if value_type == _STRING:
        (length,) = struct.unpack("<Q", file.read(8))
        file.seek(length, 1)
    elif value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", file.read(12))
        if item_type in _SCALAR_BYTES:
            file.seek(count * _SCALAR_BYTES[item_type], 1)
        else:  # strings (a vocabulary) or nested arrays: each item says its own length
            for _ in range(count):
                _skip_value(file, item_type)
    elif value_type in _SCALAR_BYTES:
        file.seek(_SCALAR_BYTES[value_type], 1)
    else:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
