"""Tool calling through `pipellm serve` and the official openai client, on a tiny Qwen2-style
checkpoint whose chat template takes `tools` (so the hermes format is detected): forced calls
valid against their schemas (whole and streamed), an agent's two-turn loop, the 400s, and the
prompt the template renders equal to transformers' rendering, token for token."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest
import transformers

from pipellm.entrypoints.openai_protocol import ChatCompletionRequest
from pipellm.entrypoints.tool_calls import template_messages
from pipellm.loader.source import resolve_model
from pipellm.testing.server_process import ServerProcess
from pipellm.text.tokenizer import load_tokenizer
from tests.checkpoints import make_tiny_checkpoint
from tests.tool_chat_templates import LLAMA31_STYLE, QWEN25_STYLE

pytestmark = pytest.mark.timeout(180)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lima"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def with_chat_template(folder, template: str, context: int = 2048):
    """The checkpoint with `template` and a context long enough for tool lists (the tiny
    tokenizer spends about a token a character on them)."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": template}))
    model_file = folder / "config.json"
    model_file.write_text(
        json.dumps({**json.loads(model_file.read_text()), "max_position_embeddings": context})
    )
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="qwen2")
    return with_chat_template(folder, QWEN25_STYLE)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    flags = ["--kv-cache-memory", str(16 * 2**20), "--enable-auto-tool-choice"]
    process = ServerProcess([str(checkpoint), *flags], tmp_path_factory.mktemp("log") / "log")
    with process:
        yield process
        assert process.stop(timeout_s=30) == [], "processes outlived the server"
        assert process.process.returncode == 0, process.log[-3000:]
    assert "tool calls: hermes format" in process.log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)


def assert_valid_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[list[dict], str, str | None]:
    """The calls a client assembles from a stream's deltas, its content, its finish reason."""
    calls: list[dict] = []
    content, finish = "", None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index == len(calls):  # a call's first delta: id, type and name
                assert delta.id.startswith("call_") and delta.type == "function"
                calls.append({"name": delta.function.name, "arguments": ""})
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    return calls, content, finish


def test_required_returns_valid_calls(client, checkpoint):
    """One call (parallel_tool_calls false: a random model would add calls until max_tokens),
    at temperature 1 with two seeds."""
    for seed in range(2):
        kwargs = dict(
            model=str(checkpoint),
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=100,
        )
        reply = client.chat.completions.create(**kwargs).choices[0]
        assert reply.finish_reason == "tool_calls", reply
        assert reply.message.content is None
        assert_valid_calls(reply.message.tool_calls)
        assert len(reply.message.tool_calls) == 1
        calls, content, finish = streamed_calls(
            client.chat.completions.create(**kwargs, stream=True)
        )
        assert (content, finish) == ("", "tool_calls")
        assert calls == [c.function.model_dump() for c in reply.message.tool_calls]


def test_named_function_returns_its_call(client, checkpoint):
    kwargs = dict(
        model=str(checkpoint),
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=100,
    )
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert_valid_calls(reply.message.tool_calls, names=("get_time",))
    assert len(reply.message.tool_calls) == 1
    calls, content, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert calls == [reply.message.tool_calls[0].function.model_dump()]
    assert (content, finish) == ("", "tool_calls")


SCRIPTED_CALL = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Lima", "unit": "C"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("script", "content", "calls"),
    [
        (SCRIPTED_CALL, "Let me check.\n", [("get_weather", '{"city": "Lima", "unit": "C"}')]),
        ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ],
    ids=["call", "malformed"],
)
def test_auto_reads_the_models_calls(client, checkpoint, script, content, calls):
    """tool_choice "auto" parses what the model writes, here scripted by a one-choice
    constraint (the random model would write no call): content before the call streams as
    text, then the call; malformed JSON comes back as content."""
    kwargs = dict(
        model=str(checkpoint),
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=100,
        extra_body={"structured_outputs": {"choice": [script]}},
    )
    reply = client.chat.completions.create(**kwargs).choices[0]
    got = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]
    assert (reply.message.content, got) == (content, calls)
    assert reply.finish_reason == ("tool_calls" if calls else "stop")
    streamed, streamed_content, finish = streamed_calls(
        client.chat.completions.create(**kwargs, stream=True)
    )
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    assert (streamed_content, finish) == (content, reply.finish_reason)


def test_two_turn_agent_loop(client, checkpoint):
    """Call, tool result, final answer, as the openai SDK's tool loop sends them."""
    messages = list(QUESTION)
    first = client.chat.completions.create(
        model=str(checkpoint),
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
    )
    call_message = first.choices[0].message
    messages.append(call_message)  # as the SDK's docs do: the reply's message object itself
    for call in call_message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"})
    final = client.chat.completions.create(
        model=str(checkpoint), messages=messages, tools=TOOLS, max_tokens=8
    )
    answer = final.choices[0]
    # The random model's text is whatever it is; the loop gets an answer, not an error.
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


def test_tools_reach_the_prompt_as_transformers_renders_them(client, checkpoint):
    """The served prompt's token ids are those of transformers' rendering of the same
    conversation (assistant call, tool result), tools included."""
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    reply = client.chat.completions.create(
        model=str(checkpoint),
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    served = [int(next(iter(entry))) for entry in reply.model_extra["prompt_logprobs"][1:]]
    theirs = transformers.AutoTokenizer.from_pretrained(checkpoint)
    text = theirs.apply_chat_template(
        transformers_messages(messages), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    expected = theirs(text, add_special_tokens=False)["input_ids"]
    assert served == expected[1:] and reply.usage.prompt_tokens == len(expected)
    assert '"name": "get_weather"' in text and "<tool_response>\n18 C" in text


def transformers_messages(messages: list[dict]) -> list[dict]:
    """The conversation as transformers documents it: call arguments as objects."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


@pytest.mark.parametrize("template", [QWEN25_STYLE, LLAMA31_STYLE], ids=["qwen2.5", "llama3.1"])
def test_templates_render_tools_as_transformers(tmp_path, template):
    folder = with_chat_template(make_tiny_checkpoint(tmp_path, num_layers=1), template)
    ours = load_tokenizer(resolve_model(str(folder)))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "18 C"},
    ]
    request = ChatCompletionRequest(messages=conversation, tools=TOOLS)
    rendered = ours.apply_chat_template(template_messages(request), tools=request.tools)
    expected = theirs.apply_chat_template(
        transformers_messages(conversation), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected
    assert '"name": "get_weather"' in rendered and "Paris" in rendered


def error_of(client, checkpoint, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=str(checkpoint), messages=QUESTION, max_tokens=4, **kwargs
        )
    body = raised.value.response.json()["error"]
    assert body["type"] == "invalid_request_error"
    return body


def test_bad_tool_requests_are_400s(client, checkpoint):
    bad_schema = copy.deepcopy(WEATHER)
    bad_schema["function"]["parameters"]["properties"]["city"]["type"] = "town"
    body = error_of(client, checkpoint, tools=[bad_schema])
    assert body["param"] == "tools" and "tools[0].function.parameters" in body["message"]
    body = error_of(
        client,
        checkpoint,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_news"}},
    )
    assert body["param"] == "tool_choice" and "'get_news'" in body["message"]
    body = error_of(client, checkpoint, tool_choice="required")
    assert body["param"] == "tool_choice" and "needs tools" in body["message"]
    body = error_of(client, checkpoint, tools=[{"type": "function"}])
    assert body["param"] == "tools" and "tools[0].function" in body["message"]
    for tool_choice in ("sometimes", 5, {"type": "function"}):
        body = error_of(client, checkpoint, tools=TOOLS, tool_choice=tool_choice)
        assert body["param"] == "tool_choice" and '"required"' in body["message"]
    body = error_of(client, checkpoint, tools="get_weather")
    assert body["param"] == "tools"
    history = [*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\].tool_calls"):
        client.chat.completions.create(model=str(checkpoint), messages=history, max_tokens=4)
    history[1]["tool_calls"] = [{"function": {"name": "f", "arguments": "{oops"}}]
    with pytest.raises(openai.BadRequestError, match="'f' are not JSON"):
        client.chat.completions.create(model=str(checkpoint), messages=history, max_tokens=4)
    body = error_of(
        client,
        checkpoint,
        tools=TOOLS,
        tool_choice="required",
        response_format={"type": "json_object"},
    )
    assert body["param"] == "tool_choice"
