"""Hermes-style calls, as Qwen2.5, Qwen3 and Hermes 2/3 models write them: each call a JSON
object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, content before
and between them (vLLM's `hermes` parser reads the same format)."""

from __future__ import annotations

from pipellm.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolCallParser,
    partial_marker_len,
    read_call,
)
from pipellm.entrypoints.tool_parsers.json_prefix import NotAnObject, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            _add_content(content, text[pos:start], after_call=bool(calls))
            close = text.find(END, start)
            block_end = len(text) if close == -1 else close + len(END)
            call = _block_call(text, start + len(START), close)
            if call is None or (call.name is None and (final or close != -1)):
                content.append(text[start:block_end])  # not a call: the model's text as written
            else:  # a call, or one whose name is still being written
                calls.append(call)
            if close == -1:
                return ParsedOutput("".join(content), calls)
            pos = block_end
        tail = text[pos:]
        if not final:  # "<tool_" may be the start of a call
            tail = tail[: len(tail) - partial_marker_len(tail, START)]
        _add_content(content, tail, after_call=bool(calls))
        return ParsedOutput("".join(content), calls)


def _add_content(content: list[str], text: str, after_call: bool) -> None:
    # The newlines between calls are layout, not content.
    if text and not (after_call and text.isspace()):
        content.append(text)


def _block_call(text: str, body: int, close: int) -> ParsedCall | None:
    """The call between the markers (close: the end marker's index, -1 before it is written),
    as far as written; None if the block is not a call."""
    body_end = len(text) if close == -1 else close
    pos = skip_whitespace(text, body)
    if pos >= body_end:
        return ParsedCall(None, "", False)
    if text[pos] != "{":
        return None
    try:
        call, end = read_call(text[:body_end], pos)
    except NotAnObject:
        return None
    if close != -1 and (end is None or skip_whitespace(text, end) < body_end):
        return None  # closed on an unfinished object, or with text after the object
    return call
