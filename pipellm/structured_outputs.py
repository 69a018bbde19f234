"""Structured outputs: the constraint a request's text must follow (JSON schema, regex,
choice, grammar), with vLLM's names (vllm/sampling_params.py StructuredOutputsParams; see
https://docs.vllm.ai/en/latest/features/structured_outputs.html).

Each constraint is compiled into an llguidance grammar (https://github.com/guidance-ai/llguidance,
the engine behind vLLM's `guidance` backend) and checked when the request is made, so that a
bad schema or regex is refused before anything is scheduled. The last pipeline stage turns the
grammar into token masks (pipellm/model/grammar_mask.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

# The constraint fields, exactly one of which a request sets (vLLM's rule).
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsError(ValueError):
    """A constraint llguidance cannot compile; `field` names it (e.g. "regex")."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"invalid structured_outputs.{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the generated text, compiled and validated on construction.

    json: a JSON schema (dict or its text); regex: the text must fully match it; choice: the
    text is one of these strings; grammar: a Lark or GBNF (llama.cpp) grammar; json_object:
    any JSON object. disable_any_whitespace keeps JSON compact (no free whitespace between
    tokens, which weak models may repeat until max_tokens); disable_additional_properties
    forbids object keys the schema does not list, as vLLM's option of that name does.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object; got {', '.join(given) or 'none'}"
            )
        if isinstance(self.json, dict):  # a canonical text: one cache entry per schema
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
        self.llguidance_grammar()  # raises StructuredOutputsError naming the field

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the cache key of its compiled grammar."""
        value = getattr(self, self.kind)
        return json.dumps(value) if self.kind in ("choice", "json_object") else value

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (compiled once per distinct constraint)."""
        return compile_grammar(
            self.kind, self.spec, self.disable_any_whitespace, self.disable_additional_properties
        )


@functools.lru_cache(maxsize=256)
def compile_grammar(
    kind: str, spec: str, disable_any_whitespace: bool, disable_additional_properties: bool
) -> str:
    """llguidance's grammar for one constraint; raises StructuredOutputsError if it is bad."""
    import llguidance

    try:
        if kind in ("json", "json_object"):
            schema = json.loads(spec) if kind == "json" else {"type": "object"}
            if not isinstance(schema, dict):
                raise StructuredOutputsError(kind, "a JSON schema must be a JSON object")
            if disable_additional_properties:
                schema = _closed_objects(schema)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": not disable_any_whitespace}
            )
        elif kind == "choice":
            choices = json.loads(spec)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise StructuredOutputsError(kind, "give a non-empty list of strings")
            grammar = llguidance.grammar_from("choice", choices)
        else:  # regex, grammar (Lark, or GBNF which llguidance converts)
            grammar = llguidance.grammar_from(kind, spec)
    except json.JSONDecodeError as error:
        raise StructuredOutputsError(kind, f"not valid JSON: {error}") from None
    except StructuredOutputsError:
        raise
    except Exception as error:  # llguidance's own errors are ValueErrors, its converters' vary
        raise StructuredOutputsError(kind, str(error)) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise StructuredOutputsError(kind, messages[0].strip())
    return grammar


def _closed_objects(schema: Any) -> Any:
    """The schema with additionalProperties false on every object that does not say."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and (
        "additionalProperties" not in closed
    ):
        closed["additionalProperties"] = False
    return closed
