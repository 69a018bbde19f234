"""Structured outputs through `pipellm serve -pp 2` and the official openai client:
response_format json_schema on chat, vLLM's structured_outputs (choice, regex, grammar) on both
endpoints, and bad constraints answered with a 400 in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from pipellm import LLM, SamplingParams
from pipellm.testing.server_process import ServerProcess
from tests.checkpoints import make_tiny_checkpoint
from tests.test_structured_outputs import CHOICES, CLOSED_SCHEMA, LARK, REGEX

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
NUM_REQUESTS = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    flags = ["-pp", "2", "--kv-cache-memory", str(16 * 2**20)]
    process = ServerProcess([checkpoint, *flags], tmp_path_factory.mktemp("log") / "log")
    with process:
        yield process
        assert process.stop(timeout_s=30) == [], "processes outlived the server"
        assert process.process.returncode == 0, process.log[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)


def json_schema_chat(model: str, seed: int) -> dict:
    """A chat request for a pet as JSON (OpenAI's strict mode closes every object, as the
    schema does: a random model would otherwise add keys)."""
    return dict(
        model=model,
        messages=MESSAGES,
        temperature=1.0,
        seed=seed,
        max_tokens=120,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "schema": CLOSED_SCHEMA, "strict": True},
        },
        # vLLM's option, beside response_format: no free whitespace for the random model.
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )


def test_json_schema_replies_parse_and_validate(server, checkpoint):
    """Twenty concurrent requests at temperature 1, in flight together over two stages: each
    reply validates, and each is the text the offline engine samples with its seed."""

    async def ask_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="-")
        async with client:
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(**json_schema_chat(checkpoint, s))
                    for s in range(NUM_REQUESTS)
                )
            )
        assert all(r.choices[0].finish_reason == "stop" for r in replies)
        return [r.choices[0].message.content for r in replies]

    texts = asyncio.run(ask_all())
    for text in texts:
        jsonschema.validate(json.loads(text), CLOSED_SCHEMA)
    assert len(set(texts)) > 1
    with LLM(checkpoint) as llm:
        params = [
            SamplingParams(
                temperature=1.0,
                seed=seed,
                max_tokens=120,
                structured_outputs=dict(json=CLOSED_SCHEMA, disable_any_whitespace=True),
            )
            for seed in range(NUM_REQUESTS)
        ]
        offline = llm.chat([MESSAGES] * NUM_REQUESTS, params, use_tqdm=False)
    assert [o.outputs[0].text for o in offline] == texts


def test_choice_regex_and_grammar_on_both_endpoints(client, checkpoint):
    chat = client.chat.completions.create(
        model=checkpoint,
        messages=MESSAGES,
        n=4,
        seed=1,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    assert {c.message.content for c in chat.choices} <= set(CHOICES)
    regex = client.completions.create(
        model=checkpoint,
        prompt="The code is",
        n=4,
        seed=2,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    assert all(re.fullmatch(REGEX, c.text) for c in regex.choices), regex.choices
    grammar = client.completions.create(
        model=checkpoint,
        prompt="The code is",
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": LARK}},
    )
    assert re.fullmatch(r"x[yz]+!", grammar.choices[0].text)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs", ["regex"]),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", ["nowhere"]),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
            ["response_format.json_schema.schema"],
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", ["needs"]),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ["yaml"]),
    ],
)
def test_bad_constraints_are_a_400_naming_them(client, checkpoint, body, param, words):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=checkpoint, messages=MESSAGES, extra_body=body)
    error = raised.value.body
    assert raised.value.status_code == 400 and error["param"] == param, error
    assert all(word in error["message"] for word in words), error
