"""Tool calling on /v1/chat/completions, as agent frameworks use it: a request's `tools` and
`tool_choice` checked, the tools handed to the model's chat template, the reply read back
into `tool_calls`.

- tool_choice "auto" (the default with tools): the model decides; its text is parsed in the
  format its chat template teaches (tool_parsers/, or --tool-call-parser).
- "required" and a named function: the reply is forced with the structured-output engine, as
  vLLM forces it: a named function's reply is its arguments object, a required call's a list
  of {"name", "parameters"} objects, each valid against its function's JSON schema, so that
  even a small model returns a call the client can run.
- "none": the tools still reach the prompt; the reply is plain content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pipellm.entrypoints.openai_protocol import ChatCompletionRequest, OpenAIError
from pipellm.entrypoints.tool_parsers import TOOL_CALL_PARSERS
from pipellm.entrypoints.tool_parsers.base import ToolCallParser
from pipellm.entrypoints.tool_parsers.forced import CallListParser, NamedFunctionParser
from pipellm.entrypoints.tool_parsers.streaming import (
    ToolCallStream,
    call_json,
    tool_calls_finish_reason,
)
from pipellm.sampling_params import SamplingParams
from pipellm.structured_outputs import StructuredOutputsError, StructuredOutputsParams

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICE_HINT = (
    'give "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}'
)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def arguments_schema(self) -> dict[str, Any]:
        # No parameters: a function called with an empty object, as OpenAI defines it.
        return self.parameters or {"type": "object", "properties": {}}


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ChosenFunction


@dataclass(frozen=True)
class ToolCalling:
    """How one chat request uses tools: what its chat template gets, how its reply is read
    (parser None: plain content), and the constraint that forces a call."""

    tools: list[dict[str, Any]] | None = None
    parser: ToolCallParser | None = None
    constraint: StructuredOutputsParams | None = None
    max_calls: int | None = None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        if self.constraint is None:
            return params
        if params.structured_outputs is not None:
            raise OpenAIError(
                "tool_choice forces a tool call, and response_format or structured_outputs "
                "constrains the reply too: give one of them",
                param="tool_choice",
            )
        return replace(params, structured_outputs=self.constraint)

    def stream(self) -> ToolCallStream:
        """One sample's stream of deltas."""
        return ToolCallStream(self.parser, self.max_calls)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole reply's message and finish reason."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = self.parser.parse(text, final=True)
        calls = [call for call in parsed.calls if call.name is not None][: self.max_calls]
        if not calls:
            return {"role": "assistant", "content": parsed.content}, finish_reason
        message = {
            "role": "assistant",
            "content": parsed.content if parsed.content.strip() else None,
            "tool_calls": [call_json(call) for call in calls],
        }
        return message, tool_calls_finish_reason(finish_reason, has_calls=True)


def plan_tool_calling(request: ChatCompletionRequest, auto_parser: str | None) -> ToolCalling:
    """Checks the request's tools and tool_choice (400s naming the field) and says how the
    request uses them; auto_parser reads tool_choice "auto" (None: this model has no known
    tool-call format)."""
    tools = _checked_tools(request.tools or [])
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise OpenAIError(
                "tool_choice needs tools: give the functions the model may call in `tools`, "
                "or leave tool_choice out",
                param="tool_choice",
            )
        return ToolCalling()
    max_calls = 1 if request.parallel_tool_calls is False else None
    if choice == "none":
        return ToolCalling(request.tools)
    if choice in (None, "auto"):
        if auto_parser is None:
            raise OpenAIError(
                'tool_choice "auto" (the default with tools) needs the format this model writes '
                "tool calls in, and its "
                "chat template names none pipellm knows: start the server with "
                f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}), or send tool_choice "
                '"required" or a named function, which need none',
                param="tool_choice",
            )
        return ToolCalling(request.tools, TOOL_CALL_PARSERS[auto_parser](), None, max_calls)
    if choice == "required":
        constraint = _required_constraint(tools, single=max_calls == 1)
        return ToolCalling(request.tools, CallListParser(), constraint, max_calls)
    function = _chosen_function(choice, tools)
    constraint = _arguments_constraint(function)
    return ToolCalling(request.tools, NamedFunctionParser(function.name), constraint, 1)


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation for the chat template: assistant tool calls' arguments as objects, as
    transformers' templates read them (`arguments | tojson`) and as vLLM hands them over."""
    messages = request.template_messages()
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            messages[i] = {
                **message,
                "tool_calls": [_history_call(c, i) for c in _listed(calls, i)],
            }
    return messages


def _listed(calls: object, i: int) -> list[Any]:
    if not isinstance(calls, list):
        raise OpenAIError(f"messages[{i}].tool_calls must be a list", param="messages")
    return calls


def _history_call(call: object, i: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIError(
            f"messages[{i}].tool_calls: each call needs "
            '{"id": ID, "type": "function", "function": {"name": NAME, "arguments": JSON}}',
            param="messages",
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise OpenAIError(
                f"messages[{i}].tool_calls: the arguments of {function['name']!r} are not "
                f"JSON ({error})",
                param="messages",
            ) from None
    return {**call, "function": {**function, "arguments": arguments}}


def _checked_tools(tools: list[dict[str, Any]]) -> list[FunctionDefinition]:
    functions: list[FunctionDefinition] = []
    for i, tool in enumerate(tools):
        try:
            function = ChatTool.model_validate(tool).function
        except ValidationError as error:
            problem = error.errors()[0]
            where = ".".join(str(part) for part in problem["loc"])
            raise OpenAIError(
                f"tools[{i}].{where}: {problem['msg']}; a tool is "
                '{"type": "function", "function": {"name", "description", "parameters"}}',
                param="tools",
            ) from None
        if not FUNCTION_NAME.fullmatch(function.name):
            raise OpenAIError(
                f"tools[{i}].function.name {function.name!r}: use 1-64 letters, digits, "
                "underscores or dashes",
                param="tools",
            )
        if any(f.name == function.name for f in functions):
            raise OpenAIError(
                f"tools[{i}]: two tools are named {function.name!r}; names must be unique",
                param="tools",
            )
        try:
            _arguments_constraint(function)
        except StructuredOutputsError as error:
            raise OpenAIError(
                f"tools[{i}].function.parameters is not a usable JSON schema: {error.reason}",
                param="tools",
            ) from None
        functions.append(function)
    return functions


def _chosen_function(choice: object, tools: list[FunctionDefinition]) -> FunctionDefinition:
    try:
        name = NamedToolChoice.model_validate(choice).function.name
    except ValidationError:
        raise OpenAIError(
            f"invalid tool_choice {choice!r}: {TOOL_CHOICE_HINT}", param="tool_choice"
        ) from None
    function = next((f for f in tools if f.name == name), None)
    if function is None:
        names = ", ".join(repr(f.name) for f in tools)
        raise OpenAIError(
            f"tool_choice names the function {name!r}, which is not in tools ({names})",
            param="tool_choice",
        )
    return function


def _arguments_constraint(function: FunctionDefinition) -> StructuredOutputsParams:
    # Compact JSON: free whitespace is where weak models loop until max_tokens. Strict
    # functions take only the keys their schema lists, as OpenAI's strict mode.
    return StructuredOutputsParams(
        json=function.arguments_schema(),
        disable_any_whitespace=True,
        disable_additional_properties=bool(function.strict),
    )


def _required_constraint(
    functions: list[FunctionDefinition], single: bool
) -> StructuredOutputsParams:
    """A list of one or more calls (one only if single), each of a listed function with
    arguments valid for it: vLLM's shape for tool_choice "required"."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f.name]},
                "parameters": f.arguments_schema(),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if single:
        schema["maxItems"] = 1
    return StructuredOutputsParams(
        json=schema,
        disable_any_whitespace=True,
        disable_additional_properties=all(f.strict for f in functions),
    )
