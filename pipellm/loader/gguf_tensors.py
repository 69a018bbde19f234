"""A GGUF file's tensors as read-only views of a fresh memory map: what a stage loads.

A stage's resident memory then holds the pages of its own tensors while it copies them, and
none of the file once its load drops the views (the map goes with the last one).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from pipellm.loader.gguf_file import TensorEntry, open_gguf

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


def read_tensor_index(path: Path) -> list[TensorEntry]:
    """The file's tensors, from its header only (no tensor byte is read)."""
    return list(open_gguf(path).tensors)


def map_tensors(path: Path) -> list[gguf.ReaderTensor]:
    """The file's tensors as gguf.GGUFReader gives them (data: read-only views of a memory map
    of the file). The map is unmapped once no view is left."""
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
