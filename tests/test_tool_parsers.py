"""Tool-call parsers on model outputs as the families write them: whole and token by token,
complete, cut mid-call, several calls, text before a call, malformed JSON."""

from __future__ import annotations

import json

import pytest

from pipellm.entrypoints.tool_parsers import detect_tool_call_parser
from pipellm.entrypoints.tool_parsers.base import ParsedCall, ToolCallParser
from pipellm.entrypoints.tool_parsers.forced import CallListParser, NamedFunctionParser
from pipellm.entrypoints.tool_parsers.hermes import HermesParser
from pipellm.entrypoints.tool_parsers.llama3_json import Llama3JsonParser
from pipellm.entrypoints.tool_parsers.streaming import ToolCallStream

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"timezone": "Europe/Paris"}'

# Outputs written the way Qwen2.5 / Hermes models write them.
HERMES_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
HERMES_TWO_CALLS = (
    f'{HERMES_CALL}\n<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}\n</tool_call>'
)
HERMES_TEXT_FIRST = f"Let me look that up for you.\n{HERMES_CALL}"
# The way Llama 3.1-3.3 write them (with the special token kept in the text, and without).
LLAMA_CALL = f'{{"name": "get_weather", "parameters": {WEATHER}}}'
LLAMA_TAGGED = f"<|python_tag|>{LLAMA_CALL}"
LLAMA_TWO_CALLS = f'{LLAMA_CALL}; {{"name": "get_time", "parameters": {TIME}}}'


def calls_of(parser: ToolCallParser, text: str) -> list[tuple[str | None, str, bool]]:
    return [(c.name, c.arguments, c.complete) for c in parser.parse(text, final=True).calls]


def streamed(parser: ToolCallParser, text: str, piece: int) -> tuple[str, list[dict], list]:
    """Feeds `text` piece characters at a time; returns the content streamed, the calls
    assembled from their deltas as a client does, and the deltas."""
    stream = ToolCallStream(parser, max_calls=None)
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict] = []
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls.append({"name": call["function"]["name"], "arguments": ""})
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
    return content, calls, deltas


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (HERMES_CALL, "", [("get_weather", WEATHER, True)]),
        (
            HERMES_TWO_CALLS,
            "",
            [("get_weather", WEATHER, True), ("get_time", TIME, True)],
        ),
        (HERMES_TEXT_FIRST, "Let me look that up for you.\n", [("get_weather", WEATHER, True)]),
        ("The weather is fine.", "The weather is fine.", []),
        # Cut by max_tokens inside the arguments: the call as far as written.
        (HERMES_CALL[:60], "", [("get_weather", HERMES_CALL[49:60], False)]),
        # Cut before the name closed: nothing to call, the text is content.
        ('<tool_call>\n{"name": "get_w', '<tool_call>\n{"name": "get_w', []),
    ],
)
def test_hermes_whole(text, content, calls):
    parsed = HermesParser().parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == calls
    for _, arguments, complete in calls:
        if complete:
            json.loads(arguments)


BROKEN_BEFORE_THE_NAME = [
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    '<tool_call>\n{"function": "get_weather", "arguments": {}}\n</tool_call>',
    "<tool_call>\n</tool_call>",
]
BROKEN_AFTER_THE_NAME = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "args": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
]


@pytest.mark.parametrize("text", BROKEN_BEFORE_THE_NAME + BROKEN_AFTER_THE_NAME)
def test_malformed_calls_are_content(text):
    """A block that is not a valid call comes back as the text it is. Streamed, the text
    streams as content too; a call whose name went out before the fault stays a call (a
    stream cannot take back what it sent)."""
    parsed = HermesParser().parse(f"Hm. {text}", final=True)
    assert (parsed.content, parsed.calls) == (f"Hm. {text}", [])
    content, calls, _ = streamed(HermesParser(), f"Hm. {text}", piece=3)
    assert content == f"Hm. {text}"
    assert [c["name"] for c in calls] == ([] if text in BROKEN_BEFORE_THE_NAME else ["get_weather"])


@pytest.mark.parametrize("text", [HERMES_CALL, HERMES_TWO_CALLS, HERMES_TEXT_FIRST])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_hermes_streamed_as_whole(text, piece):
    """Token by token the client assembles what the whole reply holds, the name before any
    argument, and the arguments arrive in fragments while they are written."""
    parser = HermesParser()
    whole = parser.parse(text, final=True)
    content, calls, deltas = streamed(parser, text, piece)
    assert content == whole.content
    assert calls == [{"name": c.name, "arguments": c.arguments} for c in whole.calls]
    first = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
    assert first["function"]["name"] == "get_weather"
    if piece == 1:
        assert first["function"]["arguments"] == ""
        fragments = [
            c for d in deltas for c in d.get("tool_calls", []) if c["function"].get("arguments")
        ]
        assert len(fragments) > len(whole.calls)  # fragments, not each call's arguments whole
        # Content is never held back past the start of the call that follows it.
        before = text.index("<tool_call>")
        assert "".join(d.get("content", "") for d in deltas[:before]) == text[:before]


def test_long_arguments_stream_token_by_token():
    """A call writing a file: thousands of characters of escaped code in one argument,
    rescanned at each of its tokens, arrive whole and in order."""
    code = "def f(x):\n    return {'a': [x, \"}\"]}\n" * 150
    arguments = json.dumps({"path": "f.py", "text": code})
    text = f'<tool_call>\n{{"name": "write_file", "arguments": {arguments}}}\n</tool_call>'
    content, calls, _ = streamed(HermesParser(), text, piece=3)
    assert (content, calls) == ("", [{"name": "write_file", "arguments": arguments}])
    assert json.loads(calls[0]["arguments"])["text"] == code


def test_hermes_holds_back_a_partial_start_marker():
    stream = ToolCallStream(HermesParser(), max_calls=None)
    assert stream.feed("Checking <tool_", final=False) == {"content": "Checking "}
    assert stream.feed("tally> done", final=True) == {"content": "<tool_tally> done"}


def test_hermes_cut_mid_call_streams_the_call_as_far_as_written():
    text = HERMES_TWO_CALLS[:-40]
    content, calls, _ = streamed(HermesParser(), text, piece=2)
    whole = HermesParser().parse(text, final=True)
    assert whole.calls[-1].complete is False
    assert calls == [{"name": c.name, "arguments": c.arguments} for c in whole.calls]
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (LLAMA_CALL, "", [("get_weather", WEATHER, True)]),
        (LLAMA_TAGGED, "", [("get_weather", WEATHER, True)]),
        ("  \n" + LLAMA_CALL, "", [("get_weather", WEATHER, True)]),
        (LLAMA_TWO_CALLS, "", [("get_weather", WEATHER, True), ("get_time", TIME, True)]),
        (f"Calling it.<|python_tag|>{LLAMA_CALL}", "Calling it.", [("get_weather", WEATHER, True)]),
        ('{"type": "function", "name": "f", "parameters": {}}', "", [("f", "{}", True)]),
        ('{"name": "now"}', "", [("now", "{}", True)]),
        # Not calls: JSON that is an answer, prose, malformed JSON, a cut before the name.
        ('{"answer": 42}', '{"answer": 42}', []),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        (
            '{"name": "f", "parameters": {"x": 1}} then',
            '{"name": "f", "parameters": {"x": 1}} then',
            [],
        ),
        ('{"nam', '{"nam', []),
        # Cut inside the arguments, and after them.
        (LLAMA_CALL[:50], "", [("get_weather", LLAMA_CALL[38:50], False)]),
        ('{"name": "f", "parameters": {"x": 1}', "", [("f", '{"x": 1}', False)]),
    ],
)
def test_llama3_json_whole(text, content, calls):
    parsed = Llama3JsonParser().parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == calls


@pytest.mark.parametrize("text", [LLAMA_CALL, LLAMA_TAGGED, LLAMA_TWO_CALLS, '{"answer": 42}'])
@pytest.mark.parametrize("piece", [1, 5])
def test_llama3_json_streamed_as_whole(text, piece):
    parser = Llama3JsonParser()
    whole = parser.parse(text, final=True)
    content, calls, _ = streamed(parser, text, piece)
    assert content == whole.content
    assert calls == [{"name": c.name, "arguments": c.arguments} for c in whole.calls]


def test_llama3_json_prose_streams_at_once():
    stream = ToolCallStream(Llama3JsonParser(), max_calls=None)
    assert stream.feed("  ", final=False) == {}  # a call may still follow the whitespace
    assert stream.feed("Sunny", final=False) == {"content": "  Sunny"}
    assert stream.feed(" <|python", final=False) == {"content": " "}


def test_forced_formats():
    named = NamedFunctionParser("get_weather")
    assert named.parse(WEATHER, final=True).calls == [ParsedCall("get_weather", WEATHER)]
    content, calls, _ = streamed(named, WEATHER, piece=3)
    assert (content, calls) == ("", [{"name": "get_weather", "arguments": WEATHER}])
    listed = (
        f'[{{"name": "get_weather", "parameters": {WEATHER}}},'
        '{"name": "now", "parameters": {}}]'
    )
    assert calls_of(CallListParser(), listed) == [
        ("get_weather", WEATHER, True),
        ("now", "{}", True),
    ]
    content, calls, _ = streamed(CallListParser(), listed, piece=2)
    assert calls == [
        {"name": "get_weather", "arguments": WEATHER},
        {"name": "now", "arguments": "{}"},
    ]


def test_max_calls_keeps_the_first():
    content, calls, _ = streamed(HermesParser(), HERMES_TWO_CALLS, piece=1000)
    stream = ToolCallStream(HermesParser(), max_calls=1)
    delta = stream.feed(HERMES_TWO_CALLS, final=True)
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["get_weather"]
    assert len(calls) == 2


def test_detected_from_the_chat_template():
    assert detect_tool_call_parser("{{ '<tool_call>' }}{{ tools | tojson }}") == "hermes"
    llama = "<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}"
    assert detect_tool_call_parser(llama) == "llama3_json"
    assert detect_tool_call_parser("{{ '<|im_start|>' }}") is None
    assert detect_tool_call_parser(None) is None
