"""Llama 3.1-3.3 JSON calls: the reply is {"name": ..., "parameters": {...}}, several joined by
";", optionally after the <|python_tag|> token (vLLM's `llama3_json` parser reads the same
format). A reply that does not start with a call is content."""

from __future__ import annotations

from pipellm.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolCallParser,
    partial_marker_len,
    read_calls,
)
from pipellm.entrypoints.tool_parsers.json_prefix import NotAnObject, skip_whitespace

# A special token: with skip_special_tokens (the default) the text never shows it, and the
# reply then starts with the call's "{".
PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        tag = text.find(PYTHON_TAG)
        if tag != -1:
            content, body = text[:tag], tag + len(PYTHON_TAG)
        else:
            content, body = "", skip_whitespace(text, 0)
            if body == len(text) or text[body] != "{":
                if final:
                    return ParsedOutput(text, [])
                if body == len(text):
                    return ParsedOutput("", [])  # only whitespace yet: a call may follow
                return ParsedOutput(text[: len(text) - partial_marker_len(text, PYTHON_TAG)], [])
        try:
            calls = read_calls(text, body, separator=";")
        except NotAnObject:
            return ParsedOutput(text, [])
        if final and any(call.name is None for call in calls):
            return ParsedOutput(text, [])  # cut before a name: nothing to call
        return ParsedOutput(content, calls)
