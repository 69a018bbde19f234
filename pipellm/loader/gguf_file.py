"""A GGUF file's header: its metadata and its tensor index, parsed once per process.

Config, tokenizer and pipeline stages all read the header; none reads it through
gguf.GGUFReader, which turns every metadata value into numpy views (about a million small
arrays for a 262k-token vocabulary: seconds per process). Scalars and strings are decoded
while the header is walked; an array is kept as its place in the file and decoded only when
asked for (the vocabulary: once, by the tokenizer), strings in one pass over their bytes and
numbers with np.frombuffer. Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# Fixed-size value types (gguf.GGUFValueType) -> their little-endian numpy dtype.
_NUMERIC_DTYPES = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
# One value of each, for struct (whose codes are not numpy's: numpy's "L" is 8 bytes, struct's 4).
_NUMERIC_FORMATS = {
    kind: struct.Struct(code)
    for kind, code in {
        0: "<B",
        1: "<b",
        2: "<H",
        3: "<h",
        4: "<I",
        5: "<i",
        6: "<f",
        7: "<?",
        10: "<Q",
        11: "<q",
        12: "<d",
    }.items()
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_ALIGNMENT_KEY = "general.alignment"
_MISSING = object()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the file's index describes it."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the innermost (row) dimension first
    offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class _ArrayPlace:
    """Where an array value lies in the file, decoded on request (see GGUFFile.value)."""

    item_type: int
    count: int
    start: int  # the first item's first byte
    end: int


class GGUFFile:
    """A GGUF file's metadata and tensor index (no tensor byte is read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as file:
            size = file.seek(0, 2)
            if size < 24:  # magic, version and the two counts
                raise ValueError(f"{path} is not a GGUF file ({size} bytes: too short)")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                try:
                    self._metadata, self.tensors = _parse_header(path, data, size)
                except struct.error:
                    raise ValueError(
                        f"{path}: the GGUF header ends before its last field: the file is "
                        "truncated or damaged; fetch it again"
                    ) from None

    def value(self, key: str, default: Any = _MISSING) -> Any:
        """The Python value of metadata field `key` (arrays become lists); `default` if absent."""
        value = self._metadata.get(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ValueError(f"{self.path}: the GGUF file has no metadata field {key!r}")
            return default
        if isinstance(value, _ArrayPlace):
            return self._read_array(key, value)
        return value

    def array_length(self, key: str) -> int:
        """The number of items of array field `key`, without decoding them."""
        place = self._metadata.get(key)
        if not isinstance(place, _ArrayPlace):
            raise ValueError(f"{self.path}: the GGUF file has no array metadata field {key!r}")
        return place.count

    def _read_array(self, key: str, place: _ArrayPlace) -> list[Any]:
        # Read afresh on each request: the reader, cached per process, keeps no big value.
        with open(self.path, "rb") as file:
            file.seek(place.start)
            raw = file.read(place.end - place.start)
        return _decode_array(self.path, key, raw, place.item_type, place.count, 0)[0]


def open_gguf(path: Path) -> GGUFFile:
    """The header of `path`, parsed once per process and file version (config, tokenizer and
    stages all read it; a file rewritten in place is parsed again)."""
    stat = Path(path).stat()
    return _open_gguf(Path(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _open_gguf(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    del mtime_ns, size  # the cache key only
    return GGUFFile(path)


def gguf_eos_token_ids(reader: GGUFFile) -> tuple[int, ...]:
    """End-of-sequence ids: eos, then end-of-turn, which llama.cpp also stops at."""
    ids = (
        reader.value("tokenizer.ggml.eos_token_id", None),
        reader.value("tokenizer.ggml.eot_token_id", None),
    )
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _parse_header(
    path: Path, data: mmap.mmap, size: int
) -> tuple[dict[str, Any], tuple[TensorEntry, ...]]:
    if data[:4] != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic at its start)")
    (version,) = _U32.unpack_from(data, 4)
    if version & 0xFFFF == 0:  # a version read in the wrong byte order
        raise ValueError(
            f"{path} is a big-endian GGUF file; pipellm reads little-endian ones (convert it "
            "with gguf's gguf_convert_endian.py)"
        )
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(
            f"{path}: GGUF version {version} is not supported (pipellm reads versions "
            f"{', '.join(map(str, _SUPPORTED_VERSIONS))})"
        )
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    offset = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, offset = _read_string(data, offset)
        (value_type,) = _U32.unpack_from(data, offset)
        if key in metadata:
            raise ValueError(f"{path}: the metadata field {key!r} appears twice")
        metadata[key], offset = _read_value(path, key, data, offset + 4, value_type)
    alignment = metadata.get(_ALIGNMENT_KEY, gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: {_ALIGNMENT_KEY} = {alignment!r} is not a power of two")
    raw = []
    for _ in range(n_tensors):
        name, offset = _read_string(data, offset)
        (n_dims,) = _U32.unpack_from(data, offset)
        shape = struct.unpack_from(f"<{n_dims}Q", data, offset + 4)
        type_id, tensor_offset = struct.unpack_from("<IQ", data, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        raw.append((name, shape, type_id, tensor_offset))
    data_start = -(-offset // alignment) * alignment
    tensors = tuple(_tensor_entry(path, *fields, data_start, size) for fields in raw)
    names = [tensor.name for tensor in tensors]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"{path}: the tensor {twice!r} appears twice in the file's index")
    return metadata, tensors


def _tensor_entry(
    path: Path,
    name: str,
    shape: tuple[int, ...],
    type_id: int,
    tensor_offset: int,
    data_start: int,
    file_bytes: int,
) -> TensorEntry:
    """The tensor's entry; ValueError naming the tensor and its type if its data cannot be
    what its header says: a type the gguf package does not know, rows that do not fill whole
    blocks, or data that runs past the end of the file (a truncated download)."""
    try:
        kind = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(
            f"{path}: tensor {name!r} has GGML type id {type_id}, which the installed gguf "
            f"package does not know; convert the file to a common type (e.g. Q8_0)"
        ) from None
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    if shape and shape[0] % block_values:
        raise ValueError(
            f"{path}: tensor {name!r} ({kind.name}, shape {list(reversed(shape))}) has rows of "
            f"{shape[0]} values, not whole {kind.name} blocks of {block_values}; the file is "
            f"damaged or was written wrongly"
        )
    n_bytes = int(np.prod(shape, dtype=np.int64)) // block_values * block_bytes
    start = data_start + tensor_offset
    if start + n_bytes > file_bytes:
        raise ValueError(
            f"{path}: tensor {name!r} ({kind.name}, shape {list(reversed(shape))}, {n_bytes} "
            f"bytes) ends at byte {start + n_bytes}, past the end of the {file_bytes}-byte "
            f"file: the file is truncated (an interrupted download or copy?); fetch it again"
        )
    return TensorEntry(name, kind, tuple(shape), start, n_bytes)


def _read_string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(data, offset)
    end = offset + 8 + length
    if end > len(data):
        raise struct.error("string past the end")
    return data[offset + 8 : end].decode("utf-8", errors="replace"), end


def _read_value(
    path: Path, key: str, data: mmap.mmap, offset: int, value_type: int
) -> tuple[Any, int]:
    """(value, the offset after it): scalars and strings decoded, arrays as their place."""
    if value_type in _NUMERIC_FORMATS:
        layout = _NUMERIC_FORMATS[value_type]
        return layout.unpack_from(data, offset)[0], offset + layout.size
    if value_type == _STRING:
        (length,) = _U64.unpack_from(data, offset)
        start = offset + 8
        return _decode_string(path, key, data[start : start + length]), start + length
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", data, offset)
        start = offset + 12
        end = _array_end(path, key, data, item_type, count, start)
        return _ArrayPlace(item_type, count, start, end), end
    raise _unknown_value_type(path, key, value_type)


def _array_end(
    path: Path, key: str, data: mmap.mmap, item_type: int, count: int, start: int
) -> int:
    if item_type in _NUMERIC_DTYPES:
        return start + count * _NUMERIC_DTYPES[item_type].itemsize
    offset = start
    if item_type == _STRING:  # each string says its own length: one walk over the lengths
        unpack_length = _U64.unpack_from
        for _ in range(count):
            offset += 8 + unpack_length(data, offset)[0]
        if offset > len(data):
            raise struct.error("array past the end")
        return offset
    for _ in range(count):  # nested arrays (rare): each item walked as a value
        _, offset = _read_value(path, key, data, offset, item_type)
    return offset


def _decode_array(
    path: Path, key: str, raw: bytes, item_type: int, count: int, offset: int
) -> tuple[list[Any], int]:
    """(the items of an array that starts at `offset` of `raw`, the offset after it)."""
    if item_type in _NUMERIC_DTYPES:
        dtype = _NUMERIC_DTYPES[item_type]
        items = np.frombuffer(raw, dtype, count, offset).tolist()
        return items, offset + count * dtype.itemsize
    if item_type == _STRING:  # one pass over the lengths and bytes
        strings = []
        unpack_length = _U64.unpack_from
        try:
            for _ in range(count):
                start = offset + 8
                offset = start + unpack_length(raw, offset)[0]
                strings.append(raw[start:offset].decode())
        except UnicodeDecodeError:
            raise _not_utf8(path, key) from None
        return strings, offset
    if item_type == _ARRAY:
        items = []
        for _ in range(count):
            inner_type, inner_count = struct.unpack_from("<IQ", raw, offset)
            item, offset = _decode_array(path, key, raw, inner_type, inner_count, offset + 12)
            items.append(item)
        return items, offset
    raise _unknown_value_type(path, key, item_type)


def _decode_string(path: Path, key: str, raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise _not_utf8(path, key) from None


def _not_utf8(path: Path, key: str) -> ValueError:
    return ValueError(
        f"{path}: the metadata field {key!r} holds bytes that are not UTF-8 text: the file is "
        "damaged"
    )


def _unknown_value_type(path: Path, key: str, value_type: int) -> ValueError:
    return ValueError(
        f"{path}: the metadata field {key!r} has value type {value_type}, which GGUF does not "
        "define: the file is damaged or newer than this pipellm"
    )
