"""A large JSON request body parsed, and later freed, in small pieces, so a prep thread never
holds the GIL for long.

`json.loads` is one C call: on a 4 MB body of 125,000 chat messages it holds the GIL for
hundreds of milliseconds, and the event loop (/health, every stream) waits that long even
though the call runs on another thread. Here the outer levels of the document (the body's
object, its arrays, and their objects) are walked in Python, and only the values below them go
through the C scanner, one per call: between calls the interpreter hands the GIL to the event
loop at its switch interval (5 ms by default). The result equals `json.loads`'s, and so do its
errors (`json.JSONDecodeError`, with the position).

Freeing a large value is one C call too (a list frees all its items at once), so
`free_in_pieces` empties big lists a slice at a time. And the cyclic garbage collector, set off
by the allocations, walks every object the body became (half a million for that chat) in one
call each time: `collection_paused` holds it off while a large body is parsed, prepared and
freed, objects that form no cycles.
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from json.decoder import WHITESPACE, scanstring
from typing import Any

# Containers nested deeper than this are scanned whole: in a request body only the outer
# levels grow large (messages[i], a choice list under structured_outputs).
WALKED_LEVELS = 3
FREE_SLICE = 1000  # items freed per call

_DECODER = json.JSONDecoder()


def loads_in_pieces(data: bytes) -> Any:
    """json.loads(data), giving up the GIL between values."""
    text = data.decode(json.detect_encoding(data), "surrogatepass")
    value, end = _value(text, _skip(text, 0), 0)
    end = _skip(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


_pause_lock = threading.Lock()
_num_pauses = 0


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic cyclic collection inside (on any thread) until every pause has ended.
    Within one, free what was made (free_in_pieces): objects still alive at the end are
    walked by the next collection, all in one call."""
    global _num_pauses
    with _pause_lock:
        _num_pauses += 1
        gc.disable()
    try:
        yield
    finally:
        with _pause_lock:
            _num_pauses -= 1
            if _num_pauses == 0:
                gc.enable()


def free_in_pieces(items: list[Any]) -> None:
    """Empties `items` a slice at a time (its last reference should be the caller's)."""
    while items:
        del items[-FREE_SLICE:]


def _skip(text: str, index: int) -> int:
    return WHITESPACE.match(text, index).end()


def _value(text: str, index: int, depth: int) -> tuple[Any, int]:
    opener = text[index : index + 1]
    if depth < WALKED_LEVELS and opener in ("{", "["):
        return _container(text, index, depth)
    return _DECODER.raw_decode(text, index)


def _container(text: str, index: int, depth: int) -> tuple[Any, int]:
    is_object = text[index] == "{"
    closer = "}" if is_object else "]"
    result: Any = {} if is_object else []
    index = _skip(text, index + 1)
    if text[index : index + 1] == closer:
        return result, index + 1
    while True:
        if is_object:
            if text[index : index + 1] != '"':
                raise json.JSONDecodeError(
                    "Expecting property name enclosed in double quotes", text, index
                )
            key, index = scanstring(text, index + 1)
            index = _skip(text, index)
            if text[index : index + 1] != ":":
                raise json.JSONDecodeError("Expecting ':' delimiter", text, index)
            index = _skip(text, index + 1)
        value, index = _value(text, index, depth + 1)
        if is_object:
            result[key] = value
        else:
            result.append(value)
        index = _skip(text, index)
        char = text[index : index + 1]
        if char == closer:
            return result, index + 1
        if char != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, index)
        index = _skip(text, index + 1)
