"""Shared access to a GGUF file's metadata and tensors (config, tokenizer and weights read it)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_MISSING = object()


class GGUFFile(gguf.GGUFReader):
    """A GGUFReader that knows its path and parses over a plain ndarray view of its memory map.

    NOTE: the parser slices the map once per vocabulary string part (about a million slices for
    SmolLM2), and every np.memmap slice runs Python-level bookkeeping; plain views cut the parse
    from ~3.5 s to ~1 s.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        # Checked before gguf maps them: its own failure on a bad tensor is a bare reshape error.
        for field in fields:
            _check_tensor_storage(self.path, field, start_offs, len(self._data))
        super()._build_tensors(start_offs, fields)

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)  # the view keeps the memmap alive as its base


def _check_tensor_storage(
    path: Path, field: gguf.ReaderField, start_offs: int, file_bytes: int
) -> None:
    """Raises ValueError naming the tensor and its type if its data cannot be what its header
    says: a type this gguf package does not know, rows that do not fill whole blocks, or data
    that runs past the end of the file (a truncated download)."""
    _, name_data, _, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", "replace")
    try:
        kind = gguf.GGMLQuantizationType(int(raw_type[0]))
    except ValueError:
        raise ValueError(
            f"{path}: tensor {name!r} has GGML type id {int(raw_type[0])}, which the installed "
            f"gguf package does not know; convert the file to a common type (e.g. Q8_0)"
        ) from None
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    shape = [int(d) for d in dims]  # GGUF lists the row length first
    if shape and shape[0] % block_values:
        raise ValueError(
            f"{path}: tensor {name!r} ({kind.name}, shape {list(reversed(shape))}) has rows of "
            f"{shape[0]} values, not whole {kind.name} blocks of {block_values}; the file is "
            f"damaged or was written wrongly"
        )
    size = int(np.prod(shape)) // block_values * block_bytes
    end = start_offs + int(offset[0]) + size
    if end > file_bytes:
        raise ValueError(
            f"{path}: tensor {name!r} ({kind.name}, shape {list(reversed(shape))}, {size} bytes) "
            f"ends at byte {end}, past the end of the {file_bytes}-byte file: the file is "
            f"truncated (an interrupted download or copy?); fetch it again"
        )


@functools.cache
def open_gguf(path: Path) -> GGUFFile:
    """A memory-mapped reader for `path`, parsed once per process (config, tokenizer and
    weights all read it)."""
    return GGUFFile(path)


def gguf_value(reader: GGUFFile, key: str, default: Any = _MISSING) -> Any:
    """The Python value of metadata field `key` (arrays become lists); `default` if absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"{reader.path}: the GGUF file has no metadata field {key!r}")
        return default
    return field.contents()


def gguf_eos_token_ids(reader: GGUFFile) -> tuple[int, ...]:
    """End-of-sequence ids: eos, then end-of-turn, which llama.cpp also stops at."""
    ids = (
        gguf_value(reader, "tokenizer.ggml.eos_token_id", None),
        gguf_value(reader, "tokenizer.ggml.eot_token_id", None),
    )
    return tuple(dict.fromkeys(i for i in ids if i is not None))
