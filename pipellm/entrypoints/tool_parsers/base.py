"""What a tool-call parser reads from a model's text: the content, and the calls as far as
they are written.

A parser is asked again each time the text grows (`final` false) and once more when the
output has ended (`final` true). While the text grows it holds back what may still turn out
to be part of a call (an unfinished start marker, a call's name not yet closed); text that
cannot be a call, such as malformed JSON, is content at once. Each answer extends the
previous one, so that a stream can send the difference (pipellm/entrypoints/tool_parsers/
streaming.py).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

from pipellm.entrypoints.tool_parsers.json_prefix import (
    NotAnObject,
    ObjectPrefix,
    scan_object,
    skip_whitespace,
)

# Keys a call object may hold: Hermes writes "arguments", Llama 3.x "parameters"; some
# Llama outputs add "type": "function".
_ARGUMENT_KEYS = ("arguments", "parameters")
_CALL_KEYS = frozenset({"name", "type", *_ARGUMENT_KEYS})


@dataclass(frozen=True)
class ParsedCall:
    name: str | None  # None until the name's string has closed
    arguments: str  # the arguments' JSON text as far as written ("{}" when a call has none)
    complete: bool = True


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: list[ParsedCall]


class ToolCallParser(ABC):
    """Reads one tool-call format; `name` is vLLM's --tool-call-parser name for it."""

    name: str

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls of `text`; with `final` the output has ended, and a call cut
        short (by max_tokens) is returned as far as written, with complete false."""


def read_call(text: str, start: int) -> tuple[ParsedCall, int | None]:
    """The call object that opens at text[start] and the index after it (None while open);
    raises NotAnObject if it is not a call or not valid JSON."""
    prefix = scan_object(text, start)
    unknown = [m.key for m in prefix.members if m.key not in _CALL_KEYS]
    if unknown:
        raise NotAnObject(f"a call object has no key {unknown[0]!r}")
    name = _name(text, prefix)
    arguments = prefix.member(*_ARGUMENT_KEYS)
    if arguments is None:
        arguments_text = ""
    elif text[arguments.value_start] != "{":
        raise NotAnObject("a call's arguments must be a JSON object")
    else:
        arguments_text = text[arguments.value_start : arguments.value_end or len(text)]
    if prefix.end is not None:
        if name is None:
            raise NotAnObject("a call object names its function")
        try:
            json.loads(text[start : prefix.end])
        except json.JSONDecodeError as error:
            raise NotAnObject(str(error)) from None
        arguments_text = arguments_text or "{}"
    return ParsedCall(name, arguments_text, prefix.end is not None), prefix.end


def read_calls(text: str, pos: int, separator: str, closer: str | None = None) -> list[ParsedCall]:
    """Call objects from text[pos] on, separated by `separator`, up to the end of the text or
    `closer`; raises NotAnObject at anything else."""
    calls: list[ParsedCall] = []
    while True:
        pos = skip_whitespace(text, pos)
        if pos == len(text) or (closer is not None and text[pos] == closer):
            return calls
        if text[pos] != "{":
            raise NotAnObject(f"expected a call object at character {pos}")
        call, end = read_call(text, pos)
        calls.append(call)
        if end is None:
            return calls
        pos = skip_whitespace(text, end)
        if pos < len(text) and text[pos] == separator:
            pos += 1
        elif pos < len(text) and text[pos] != closer:
            raise NotAnObject(f"expected {separator!r} at character {pos}")


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back while streaming)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _name(text: str, prefix: ObjectPrefix) -> str | None:
    member = prefix.member("name")
    if member is None or member.value_end is None:
        return None
    name = json.loads(text[member.value_start : member.value_end])
    if not isinstance(name, str):
        raise NotAnObject("a call's name must be a string")
    return name
