"""Structured outputs (vLLM's `structured_outputs`, OpenAI's `response_format`) offline: bad
constraints fail on construction naming the field; the token masks ban exactly what the
grammar forbids; sampled text at temperature 1 always follows the constraint, under
preemption too, with the same tokens either way."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from pipellm import LLM, SamplingParams
from pipellm.protocol import ScheduledRequest, SchedulerOutput
from pipellm.structured_outputs import StructuredOutputsParams
from pipellm.text.tokenizer import Tokenizer
from pipellm.worker.structured_output import GrammarMasks
from tests.checkpoints import EOS_TOKEN_ID, make_tiny_checkpoint, make_tiny_tokenizer

pytestmark = pytest.mark.timeout(180)

# Nested object, enum, array; closed and bounded so that a random model's text ends in time.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "age": {"type": "integer"}},
            "required": ["ok"],
        },
    },
    "required": ["name", "kind", "tags", "owner"],
}
# SCHEMA with every object closed: what disable_additional_properties makes of it.
CLOSED_SCHEMA = {
    **SCHEMA,
    "additionalProperties": False,
    "properties": {
        **SCHEMA["properties"],
        "owner": {**SCHEMA["properties"]["owner"], "additionalProperties": False},
    },
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma delta"]
LARK = 'start: "x" ("y" | "z")+ "!"'
PROMPT = "The quick brown fox"


def tiny_tokenizer() -> Tokenizer:
    backend = make_tiny_tokenizer()
    return Tokenizer(
        backend,
        bos_token_id=None,
        eos_token_ids=(EOS_TOKEN_ID,),
        chat_template=None,
        add_bos_token=False,
    )


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(regex="[unclosed"), ["structured_outputs.regex", "unclosed character class"]),
        (dict(json="{bad"), ["structured_outputs.json", "not valid JSON"]),
        (dict(json="[1, 2]"), ["structured_outputs.json", "JSON object"]),
        (dict(grammar="start: nowhere"), ["structured_outputs.grammar", "nowhere"]),
        (dict(choice=[]), ["structured_outputs.choice", "non-empty"]),
        (dict(choice=["a", 3]), ["structured_outputs.choice", "strings"]),
        (dict(regex="a", choice=["a"]), ["exactly one", "regex, choice"]),
        (dict(disable_any_whitespace=True), ["exactly one", "none"]),
        (dict(jsn={}), ["structured_outputs", "jsn"]),
    ],
)
def test_bad_constraints_fail_naming_the_field(fields, words):
    with pytest.raises(ValueError) as raised:
        SamplingParams(structured_outputs=fields)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_json_schemas_are_one_constraint_whatever_their_key_order():
    first = StructuredOutputsParams(json={"type": "object", "required": []})
    second = StructuredOutputsParams(json={"required": [], "type": "object"})
    assert first.spec == second.spec
    assert first.llguidance_grammar() is second.llguidance_grammar()  # compiled once


def test_masks_ban_exactly_what_each_grammar_forbids():
    """Each constrained row keeps the logits of the tokens its matcher accepts next, and only
    those; an unconstrained row is untouched; output tokens advance the matcher."""
    tokenizer = tiny_tokenizer()
    masks = GrammarMasks(lambda: tokenizer, 300, ())
    regex = SamplingParams(structured_outputs=dict(regex=REGEX))
    choice = SamplingParams(structured_outputs=dict(choice=CHOICES))
    prompt = tokenizer.encode(PROMPT)
    output = tokenizer.encode("ab-1", add_special_tokens=False)
    tokens = {"r": prompt + output, "plain": prompt, "c": prompt}
    items = [
        ScheduledRequest("r", 0, 1, [], [], num_output_tokens=len(output), sample=True),
        ScheduledRequest("plain", 0, 1, [], [], sample=True),
        ScheduledRequest("c", 0, 1, [], [], sample=True),
    ]
    logits = torch.randn(3, 300)
    masked = logits.clone()
    assert masks.apply(masked, items, [regex, SamplingParams(), choice], tokens.get) == {}
    assert torch.equal(masked[1], logits[1])
    llg_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=EOS_TOKEN_ID)
    for row, params, consumed in [(0, regex, output), (2, choice, [])]:
        grammar = params.structured_outputs.llguidance_grammar()
        reference = llguidance.LLMatcher(llg_tokenizer, grammar)
        assert reference.consume_tokens(consumed)
        accepts = torch.tensor([reference.validate_tokens([t]) == 1 for t in range(300)])
        assert 0 < accepts.sum() < 300
        assert torch.equal(masked[row][accepts], logits[row][accepts])
        assert torch.isinf(masked[row][~accepts]).all()
    # The next step brings one more output token: only it is consumed.
    tokens["r"].append(tokenizer.encode("2", add_special_tokens=False)[0])
    items[0].num_output_tokens += 1
    masks.apply(torch.randn(1, 300), items[:1], [regex], tokens.get)
    assert masks.matchers["r"].num_consumed == len(output) + 1
    masks.update(SchedulerOutput(1, [], freed_request_ids=["r"]))
    assert "r" not in masks.matchers


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), CLOSED_SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"x[yz]+!", text), text


CONSTRAINTS = {
    "json": dict(json=SCHEMA, disable_any_whitespace=True, disable_additional_properties=True),
    "regex": dict(regex=REGEX),
    "choice": dict(choice=CHOICES),
    "grammar": dict(grammar=LARK),
}


def sample_all(llm: LLM) -> dict[str, list[str]]:
    """Eight samples of each constraint at temperature 1, all in flight together."""
    params = [
        SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=100, structured_outputs=fields)
        for fields in CONSTRAINTS.values()
    ]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    texts = {}
    for kind, output in zip(CONSTRAINTS, outputs, strict=True):
        assert all(o.finish_reason == "stop" for o in output.outputs), output.outputs
        texts[kind] = [o.text for o in output.outputs]
    return texts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_sampled_text_follows_the_constraint_under_preemption(checkpoint):
    """A KV cache too small for all 32 samples (so some are preempted and recomputed) gives
    the same texts as one that holds them all: each sample's matcher follows its own tokens.
    Every text follows its constraint. (-pp 2: tests/test_request_isolation.py.)"""
    with LLM(checkpoint) as llm:
        texts = sample_all(llm)
    for kind, samples in texts.items():
        assert len(set(samples)) > 1, samples  # the samples differ: each has its own state
        for text in samples:
            check(kind, text)
    small_cache = 12 * 16 * 2 * 4 * 2 * 16 * 4  # 12 blocks of 16 tokens
    with LLM(checkpoint, kv_cache_memory=small_cache, max_model_len=128) as llm:
        assert sample_all(llm) == texts
        assert llm.engine.scheduler.num_preemptions > 0
