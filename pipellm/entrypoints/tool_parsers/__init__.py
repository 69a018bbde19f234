"""Tool-call formats by vLLM's --tool-call-parser names, and the one a model's chat template
asks for."""

from __future__ import annotations

import argparse

from pipellm.entrypoints.tool_parsers.base import ToolCallParser
from pipellm.entrypoints.tool_parsers.hermes import HermesParser
from pipellm.entrypoints.tool_parsers.llama3_json import Llama3JsonParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The format the chat template teaches the model, or None if it teaches none we read."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:  # Qwen2.5, Qwen3, Hermes 2/3
        return HermesParser.name
    # Llama 3.1-3.3: <|python_tag|> (3.1, 3.3), or JSON calls with "parameters" (3.2).
    llama_headers = "<|start_header_id|>" in chat_template
    if llama_headers and ("<|python_tag|>" in chat_template or "parameters" in chat_template):
        return Llama3JsonParser.name
    return None


def add_tool_call_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool calling")
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        help='the format tool_choice "auto" reads calls in: hermes (<tool_call> JSON: Qwen2.5, '
        "Qwen3, Hermes) or llama3_json (Llama 3.1-3.3 JSON); default: the one the model's chat "
        "template teaches",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='accepted for vLLM\'s command lines: tool_choice "auto" is on whenever the '
        "tool-call format is known",
    )


def resolve_tool_call_parser(flag: str | None, chat_template: str | None) -> str | None:
    """--tool-call-parser, else the format the chat template teaches (None: unknown)."""
    return flag or detect_tool_call_parser(chat_template)
