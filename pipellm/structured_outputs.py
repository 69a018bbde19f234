"""Structured outputs: the constraint a request's text must follow (JSON schema, regex,
choice, grammar), with vLLM's names (vllm/sampling_params.py StructuredOutputsParams; see
https://docs.vllm.ai/en/latest/features/structured_outputs.html).

Each constraint is compiled into an llguidance grammar (https://github.com/guidance-ai/llguidance,
the engine behind vLLM's `guidance` backend) and checked when the request is made, so that a
bad schema or regex is refused before anything is scheduled. The last pipeline stage turns the
grammar into token masks (pipellm/worker/structured_output.py).

What one constraint may cost is bounded twice: its size is checked before compiling (the
MAX_* limits below), and llguidance's own work limits (`parser_limits`, the same in the API
process and on the last stage) turn a grammar whose lexer or parser would explode into an
error instead of seconds of CPU and hundreds of MB. `probe` then runs a fresh matcher a few
tokens with the real tokenizer, where llguidance reports the limits it only meets once text
flows (an Earley row over its item limit, a regex lexer past its budget).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import llguidance
    import tokenizers


class TokenizerLike(Protocol):
    """What llguidance needs of pipellm's Tokenizer (text/, a layer above this module)."""

    backend: tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int: ...


# The constraint fields, exactly one of which a request sets (vLLM's rule).
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")

# Size limits, checked before anything is compiled. A choice list is one grammar rule with an
# alternative per item, and llguidance's Earley parser fails a row of more than 2,000 items
# (LLParserLimits.max_items_in_row): 1,000 leaves room for the items around them.
MAX_CHOICES = 1000
MAX_CHOICE_CHARS = 64 * 1024  # all the choices' characters together
MAX_GRAMMAR_CHARS = 64 * 1024  # a grammar, or a JSON schema as text
MAX_REGEX_CHARS = 4 * 1024
MAX_CONSTRAINT_CHARS = {"json": MAX_GRAMMAR_CHARS, "grammar": MAX_GRAMMAR_CHARS}
MAX_CONSTRAINT_CHARS["regex"] = MAX_REGEX_CHARS
# How a request's error starts when its grammar failed on the last stage: the API answers it
# as the client's fault (400), not as an engine bug.
STRUCTURED_OUTPUT_FAILED = "structured output failed"
# How many tokens `probe` feeds a fresh matcher (the first allowed token each time).
PROBE_TOKENS = 4


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
        self._check_size()
        self.llguidance_grammar()  # raises StructuredOutputsError naming the field

    def _check_size(self) -> None:
        """Refuses a constraint over the MAX_* limits before anything compiles it."""
        kind = self.kind
        if kind == "choice":
            if len(self.choice) > MAX_CHOICES:
                raise StructuredOutputsError(
                    kind, f"{len(self.choice)} items, over the limit of {MAX_CHOICES}"
                )
            chars = sum(len(c) for c in self.choice if isinstance(c, str))
            if chars > MAX_CHOICE_CHARS:
                raise StructuredOutputsError(
                    kind, f"{chars} characters in all, over the limit of {MAX_CHOICE_CHARS}"
                )
        limit = MAX_CONSTRAINT_CHARS.get(kind)
        if limit is not None and len(self.spec) > limit:
            raise StructuredOutputsError(
                kind, f"{len(self.spec)} characters, over the limit of {limit}"
            )

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
        raise StructuredOutputsError(kind, first_line(str(error))) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, limits=parser_limits()
    )
    if is_error:
        raise StructuredOutputsError(kind, messages[0].strip())
    return grammar


@functools.cache
def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's work limits, lower than its defaults where a hostile regex or grammar
    would otherwise take seconds and hundreds of MB to fail (its defaults: 1,000,000 initial
    lexer fuel, 250,000 lexer states); every constraint of the test suite and the docs fits."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, max_lexer_states=50_000)


def llguidance_tokenizer(
    tokenizer: TokenizerLike, vocab_size: int, model_eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it. A complete grammar allows the tokens the engine
    stops at: the tokenizer's EOS and the model's. The model's logits may be wider than the
    tokenizer (padded vocabularies): masks cover every logit, and ids no token has are never
    allowed."""
    import llguidance

    eos = sorted(set(tokenizer.eos_token_ids) | set(model_eos_token_ids))
    size = max(vocab_size, tokenizer.vocab_size)
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=size, eos_token=eos)


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher of `grammar` for `tokenizer`, under `parser_limits` (check `is_error()`)."""
    import llguidance

    return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())


def probe(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> None:
    """Raises StructuredOutputsError if a fresh matcher of the constraint fails within its
    first PROBE_TOKENS tokens (always taking the lowest allowed token id). Leaves nothing
    behind: the matcher is dropped either way."""
    import numpy as np

    matcher = new_matcher(tokenizer, params.llguidance_grammar())
    bitmask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(PROBE_TOKENS):
        if matcher.is_error() or matcher.is_stopped():
            break
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        if matcher.is_error():
            break
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
        if not len(allowed):
            break
        matcher.consume_token(int(allowed[0]))
    if matcher.is_error():
        raise StructuredOutputsError(params.kind, first_line(matcher.get_error()))


def first_line(reason: str) -> str:
    """llguidance's errors go on with its parser state over many lines: the first says it."""
    return reason.strip().splitlines()[0] if reason.strip() else "unknown error"


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
