"""Tool calling on the built-in SmolLM2-135M-Instruct through `pipellm serve` and the openai
client: its chat template teaches no tool-call format, yet "required" and named calls come back
valid against their schemas (forced by the structured-output engine), whole and streamed, and
an agent's two-turn loop runs."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pipellm.testing.server_process import ServerProcess
from tests.test_tool_calls_server import QUESTION, SCHEMAS, TOOLS, streamed_calls

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    flags = ["--kv-cache-memory", str(64 * 2**20), "--max-model-len", "1024"]
    process = ServerProcess(flags, tmp_path_factory.mktemp("log") / "log")
    with process:
        yield openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="-", max_retries=0)
        assert process.stop(timeout_s=30) == [], "processes outlived the server"
        assert process.process.returncode == 0, process.log[-3000:]
    assert "tool calls: no known format" in process.log


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_calls_validate(client, tool_choice):
    model = client.models.list().data[0].id
    kwargs = dict(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, temperature=0
    )
    reply = client.chat.completions.create(**kwargs, max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if tool_choice != "required":
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    stream = client.chat.completions.create(**kwargs, max_tokens=120, stream=True)
    calls, content, finish = streamed_calls(stream)
    assert (content, finish) == ("", "tool_calls")
    assert calls == [c.function.model_dump() for c in choice.message.tool_calls]


def test_agent_loop_and_auto(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120
    )
    call_message = first.choices[0].message
    messages.append(call_message.model_dump(exclude_none=True))
    for call in call_message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    final = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # "auto" needs the model's format, which SmolLM2's template does not teach.
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=4)
