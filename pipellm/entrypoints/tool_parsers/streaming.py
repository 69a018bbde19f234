"""A streamed reply's tool calls, sent as OpenAI streams them: a call's first delta holds its
index, id, type and name, the following ones fragments of its arguments; content before (and
between) calls streams as text."""

from __future__ import annotations

import uuid
from typing import Any

from pipellm.entrypoints.tool_parsers.base import ParsedCall, ToolCallParser


def tool_calls_finish_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    # A reply that ended on its own after calls asks the client to run them; one cut by
    # max_tokens keeps "length".
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's shape: "call_" and 24 characters


def call_json(call: ParsedCall) -> dict[str, Any]:
    """A call in a whole (non-streamed) reply."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": new_call_id(), "type": "function", "function": function}


class ToolCallStream:
    """Turns one sample's growing text into deltas. The parser is asked anew each time and
    what it answers beyond what was sent goes out; nothing sent is taken back (a call whose
    name has gone out stays a call). Without a parser the text is content as it comes."""

    def __init__(self, parser: ToolCallParser | None, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = ""
        self.sent_arguments: list[str] = []  # per call sent: its arguments so far

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return tool_calls_finish_reason(finish_reason, has_calls=bool(self.sent_arguments))

    def feed(self, new_text: str, final: bool) -> dict[str, Any]:
        """The delta of a chunk, for `new_text` (final: the output has ended)."""
        if self.parser is None:
            return {"content": new_text}
        self.text += new_text
        parsed = self.parser.parse(self.text, final)
        delta: dict[str, Any] = {}
        content = parsed.content
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            delta["content"] = content[len(self.sent_content) :]
            self.sent_content = content
        calls = [
            self._call_delta(index, call)
            for index, call in enumerate(parsed.calls[: self.max_calls])
            if call.name is not None
        ]
        calls = [call for call in calls if call]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _call_delta(self, index: int, call: ParsedCall) -> dict[str, Any] | None:
        if index > len(self.sent_arguments):
            return None  # an earlier call has no name yet
        head: dict[str, Any] = {}
        if index == len(self.sent_arguments):
            self.sent_arguments.append("")
            head = {"id": new_call_id(), "type": "function"}
            function = {"name": call.name, "arguments": ""}
        else:
            function = {}
        sent = self.sent_arguments[index]
        if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
            function["arguments"] = call.arguments[len(sent) :]
            self.sent_arguments[index] = call.arguments
        if not function:
            return None
        return {"index": index, **head, "function": function}
