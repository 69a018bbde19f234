"""The outputs of tool_choice "required" and a named function, whose shape the structured-output
grammar forces (pipellm/entrypoints/tool_calls.py), as vLLM forces them: a named function's
reply is its arguments object alone; a required call's is a JSON list of
{"name": ..., "parameters": {...}} objects."""

from __future__ import annotations

import json

from pipellm.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolCallParser,
    read_calls,
)
from pipellm.entrypoints.tool_parsers.json_prefix import NotAnObject, skip_whitespace


class NamedFunctionParser(ToolCallParser):
    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        try:
            complete = isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            complete = False
        return ParsedOutput("", [ParsedCall(self.function_name, text.strip(), complete)])


class CallListParser(ToolCallParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_whitespace(text, 0)
        if start == len(text):
            return ParsedOutput("", [])
        try:
            if text[start] != "[":
                raise NotAnObject("expected a list of calls")
            return ParsedOutput("", read_calls(text, start + 1, separator=",", closer="]"))
        except NotAnObject:
            return ParsedOutput(text, [])
