"""Where the members of a JSON object lie in text that may still be growing.

A streamed tool call is a JSON object written token by token: to send the function's name as
soon as it is complete and its arguments fragment by fragment, the server must know which part
of the text is which before the object closes. This scanner finds the object's top-level keys
and the span of each value; it checks structure only (brackets, strings, separators), and the
complete object is checked by `json.loads` afterwards.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_SCALAR_CHARS = frozenset("-+.0123456789eEtruefalsn")  # numbers, true, false, null
# A string's text and its closing quote (escapes skipped whole).
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET_OR_QUOTE = re.compile(r'[\[\]{}"]')


class NotAnObject(ValueError):
    """The text cannot be the beginning of a JSON object: no further text can fix it."""


@dataclass(frozen=True)
class Member:
    key: str
    value_start: int
    value_end: int | None  # None while the value is still being written


@dataclass(frozen=True)
class ObjectPrefix:
    members: list[Member]
    end: int | None  # index just after the closing brace; None while the object is open

    def member(self, *keys: str) -> Member | None:
        return next((m for m in self.members if m.key in keys), None)


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def scan_object(text: str, start: int) -> ObjectPrefix:
    """The members of the object that opens at text[start] ("{"), as far as text goes; raises
    NotAnObject at the first character no JSON object could have there."""
    members: list[Member] = []
    pos = skip_whitespace(text, start + 1)
    if pos < len(text) and text[pos] == "}":
        return ObjectPrefix(members, pos + 1)
    while pos < len(text):
        if text[pos] != '"':
            raise NotAnObject(f"expected a key at character {pos}")
        key_end = _string_end(text, pos)
        if key_end is None:
            break
        key = json.loads(text[pos:key_end])
        pos = skip_whitespace(text, key_end)
        if pos == len(text):
            break
        if text[pos] != ":":
            raise NotAnObject(f"expected ':' at character {pos}")
        value_start = skip_whitespace(text, pos + 1)
        if value_start == len(text):
            break
        value_end = _value_end(text, value_start)
        members.append(Member(key, value_start, value_end))
        if value_end is None:
            break
        pos = skip_whitespace(text, value_end)
        if pos == len(text):
            break
        if text[pos] == "}":
            return ObjectPrefix(members, pos + 1)
        if text[pos] != ",":
            raise NotAnObject(f"expected ',' or '}}' at character {pos}")
        pos = skip_whitespace(text, pos + 1)
    return ObjectPrefix(members, None)


def _string_end(text: str, start: int) -> int | None:
    """Index after the string that opens at text[start] ('"'), or None if it is not closed."""
    closed = _STRING_REST.match(text, start + 1)
    return None if closed is None else closed.end()


def _value_end(text: str, start: int) -> int | None:
    """Index after the value that starts at text[start], or None if it is not finished."""
    char = text[start]
    if char == '"':
        return _string_end(text, start)
    if char in "{[":
        # Regex jumps between brackets and strings: a streamed call is rescanned as each
        # token arrives, so arguments thousands of characters long must scan at C speed.
        depth, pos = 0, start
        while (found := _BRACKET_OR_QUOTE.search(text, pos)) is not None:
            pos = found.start()
            if text[pos] == '"':
                end = _string_end(text, pos)
                if end is None:
                    return None
                pos = end
                continue
            depth += 1 if text[pos] in "{[" else -1
            if depth == 0:
                return pos + 1
            pos += 1
        return None
    if char not in _SCALAR_CHARS:
        raise NotAnObject(f"unexpected {char!r} at character {start}")
    pos = start
    while pos < len(text) and text[pos] in _SCALAR_CHARS:
        pos += 1
    return None if pos == len(text) else pos
