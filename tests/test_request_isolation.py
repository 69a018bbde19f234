"""`pipellm serve -pp 2` with an API key, one server for the module (the suite's time).

No request can stall or poison another: bad structured-output constraints are 400s in OpenAI's
error shape (the second try too), the slow ones run off the event loop while /health answers,
memory comes back; float32 underflow in sampling values; the API's small promises
(/v1/models, docs behind the key, OpenAPI's declared errors, /health's body, 405's Allow
header). Structured outputs through the official openai client: response_format json_schema
on chat, vLLM's structured_outputs (choice, regex, grammar) on both endpoints, bad constraints
answered with a 400 naming them. `pipellm bench serve` against the server. And, last, the
graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import jsonschema
import openai
import psutil
import pytest

from pipellm import LLM, SamplingParams
from pipellm.entrypoints import cli
from pipellm.structured_outputs import MAX_CHOICES
from pipellm.testing.server_process import ServerProcess
from tests.checkpoints import make_tiny_checkpoint
from tests.test_hostile_http import raw_http
from tests.test_structured_outputs import CHOICES, CLOSED_SCHEMA, LARK, REGEX

pytestmark = pytest.mark.timeout(180)

API_KEY = "isolation-key"
AUTH = f"Authorization: Bearer {API_KEY}\r\n"
SERVED_NAME = "tiny-model"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# The issue asks for 100 ms; this is its slowest answer's bound on a 2-core machine loaded by
# other jobs, where the OS alone delays the server by a time slice or more (measured at load
# average 7: 0.14-0.23 s; idle: under 10 ms). A compile on the event loop stalled it for 18 s,
# and the 4 MB chat's one json.loads and the garbage collector walking its 500,000 objects for
# 2-3 s at load average 12.
HEALTH_BOUND_S = 0.5


def assert_responsive(latencies: list[float]) -> None:
    """/health kept answering while a slow request's work ran: none of it held the loop."""
    assert max(latencies) < HEALTH_BOUND_S, sorted(latencies)[-5:]


SHUTDOWN_TIMEOUT_S = 1.0
NUM_REQUESTS = 16  # half streamed; in each half, half short enough to finish in the drain


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    flags = ["-pp", "2", "--kv-cache-memory", str(16 * 2**20), "--api-key", API_KEY]
    flags += ["--served-model-name", SERVED_NAME, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    process = ServerProcess([checkpoint, *flags], tmp_path_factory.mktemp("log") / "log")
    with process:
        yield process
        assert process.stop(timeout_s=30) == [], "processes outlived the server"
        assert process.process.returncode == 0, process.log[-3000:]


def request(
    server: ServerProcess, method: str, path: str, body: dict | None = None, auth: bool = True
) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-case headers, body) of one request on its own connection."""
    data = b"" if body is None else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n{AUTH if auth else ''}\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), 120) as sock:
        sock.sendall(head.encode() + data)
        reply = b""
        while chunk := sock.recv(1 << 16):
            reply += chunk
    head_bytes, _, payload = reply.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split(" ")[1]), {k.lower(): v for k, v in headers.items()}, payload


def error_of(status: int, payload: bytes, expected: int) -> dict:
    assert status == expected, payload[:500]
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


class HealthWatch:
    """Polls /health on its own thread while a slow request runs; the slowest answer."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll)

    def _poll(self) -> None:
        health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        while not self._stop.is_set():
            started = time.perf_counter()
            status, _ = raw_http(self.server, health)
            self.latencies.append(time.perf_counter() - started)
            self.statuses.append(status)
            time.sleep(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def many_alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"a{i}"' for i in range(n))


# The bodies: a library limit (Earley row items, lexer expressions) or a size limit.
BAD_CONSTRAINTS = [
    ({"choice": [f"c{i}" for i in range(2001)]}, f"over the limit of {MAX_CHOICES}"),
    ({"grammar": many_alternatives(3000)}, "max is 2000"),
    ({"regex": "(y{1000}){1000}"}, "too many expressions"),
]


@pytest.mark.parametrize(("constraint", "words"), BAD_CONSTRAINTS)
def test_constraint_problems_are_400s_twice_and_logged(server, constraint, words):
    body = {"prompt": "hi", "max_tokens": 4, "structured_outputs": constraint}
    for _ in range(2):  # a failed compile leaves nothing cached: the second try fails alike
        error = error_of(*_status_body(request(server, "POST", COMPLETIONS, body)), 400)
        assert words in error["message"] and error["param"] == "structured_outputs"
    assert words in server.log  # logged with its reason
    fine = {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}
    status, _, payload = request(server, "POST", COMPLETIONS, fine)
    assert status == 200 and json.loads(payload)["choices"][0]["text"] in ("yes", "no")


def test_a_huge_choice_list_neither_stalls_nor_grows_the_server(server):
    body = {
        "prompt": "hi",
        "max_tokens": 4,
        "structured_outputs": {"choice": [f"option {i}" for i in range(100_000)]},
    }
    process = psutil.Process(server.process.pid)
    request(server, "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 1})
    before = process.memory_info().rss
    with HealthWatch(server) as watch:
        for _ in range(3):
            error = error_of(*_status_body(request(server, "POST", COMPLETIONS, body)), 400)
            assert "100000 items" in error["message"]
    assert set(watch.statuses) == {200}
    assert_responsive(watch.latencies)
    assert process.memory_info().rss - before < 50 * 2**20


def test_a_huge_chat_is_templated_off_the_event_loop(server):
    body = {"messages": [{"role": "user", "content": ""}] * 125_000, "max_tokens": 1}
    with HealthWatch(server) as watch:
        for _ in range(2):
            error = error_of(*_status_body(request(server, "POST", CHAT, body)), 400)
            assert "--max-prompt-chars" in error["message"]
    assert len(watch.latencies) > 1 and set(watch.statuses) == {200}
    assert_responsive(watch.latencies)


def test_float32_underflow_is_clamped_or_refused(server):
    prompt = {"prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True}
    greedy = request(server, "POST", COMPLETIONS, {**prompt, "temperature": 0})
    tiny_top_p = request(server, "POST", COMPLETIONS, {**prompt, "top_p": 1e-300})
    texts = [json.loads(reply[2])["choices"][0]["text"] for reply in (greedy, tiny_top_p)]
    assert texts[0] == texts[1]  # top_p raised to 1e-8 keeps the likeliest token: greedy
    tiny_temperature = request(server, "POST", COMPLETIONS, {**prompt, "temperature": 1e-300})
    assert tiny_temperature[0] == 200
    assert "<|endoftext|>" * 8 != json.loads(tiny_temperature[2])["choices"][0]["text"]
    for field, value in (("repetition_penalty", 1e-308), ("temperature", 1e300)):
        status, _, payload = request(server, "POST", COMPLETIONS, {**prompt, field: value})
        assert field in error_of(status, payload, 400)["message"]


def test_small_promises_of_the_api(server):
    status, headers, payload = request(server, "GET", "/health", auth=False)
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(payload) == {"status": "ok"}
    card = json.loads(request(server, "GET", "/v1/models")[2])["data"][0]
    assert card["id"] == card["root"] == SERVED_NAME
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert request(server, "GET", path, auth=False)[0] == 401
        assert request(server, "GET", path)[0] == 200
    schema = json.loads(request(server, "GET", "/openapi.json")[2])
    for path in (COMPLETIONS, CHAT):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and "400" in responses
    status, headers, payload = request(server, "TRACE", "/v1/models")
    assert status == 405 and headers["allow"] == "GET"
    error_of(status, payload, 405)


def _status_body(reply: tuple[int, dict[str, str], bytes]) -> tuple[int, bytes]:
    return reply[0], reply[2]


def send(port: int, body: dict, replies: dict[int, tuple[int, str, bytes]], key: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = json.dumps(body)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
        connection.request("POST", "/v1/completions", data, headers)
        response = connection.getresponse()
        content_type = response.getheader("content-type", "")
        replies[key] = (response.status, content_type, response.read())
    except (http.client.HTTPException, OSError) as error:  # cut off: what the drain prevents
        replies[key] = (0, "", repr(error).encode())
    finally:
        connection.close()


def engine_sequences(server: ServerProcess) -> int:
    """Sequences (each of n samples) running or waiting in the engine, from /metrics."""
    _, _, payload = request(server, "GET", "/metrics", auth=False)
    gauges = ("pipellm:num_requests_running{", "pipellm:num_requests_waiting{")
    lines = payload.decode().splitlines()
    return sum(int(float(line.split()[-1])) for line in lines if line.startswith(gauges))


def stream_events(payload: bytes) -> list[str]:
    return [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]


MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
NUM_STRUCTURED_REQUESTS = 20


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


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
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
        async with client:
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(**json_schema_chat(SERVED_NAME, s))
                    for s in range(NUM_STRUCTURED_REQUESTS)
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
            for seed in range(NUM_STRUCTURED_REQUESTS)
        ]
        offline = llm.chat([MESSAGES] * NUM_STRUCTURED_REQUESTS, params, use_tqdm=False)
    assert [o.outputs[0].text for o in offline] == texts


def test_choice_regex_and_grammar_on_both_endpoints(client):
    chat = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        n=4,
        seed=1,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    assert {c.message.content for c in chat.choices} <= set(CHOICES)
    regex = client.completions.create(
        model=SERVED_NAME,
        prompt="The code is",
        n=4,
        seed=2,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    assert all(re.fullmatch(REGEX, c.text) for c in regex.choices), regex.choices
    grammar = client.completions.create(
        model=SERVED_NAME,
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
def test_bad_constraints_are_a_400_naming_them(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, extra_body=body)
    error = raised.value.body
    assert raised.value.status_code == 400 and error["param"] == param, error
    assert all(word in error["message"] for word in words), error


def test_bench_serve_against_pipellm_serve(server, checkpoint, tmp_path: Path, capsys, monkeypatch):
    """`pipellm bench serve` against the real `pipellm serve` (two pipeline stages): no
    failures, and the figures agree with what the server was asked for."""
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # bench serve's key, as the openai clients'
    bench = ["bench", "serve", "--base-url", server.base_url, "--tokenizer", checkpoint]
    bench += ["--dataset-name", "random", "--num-prompts", "24", "--max-concurrency", "6"]
    bench += ["--random-input-len", "40", "--random-output-len", "12", "--num-warmups", "2"]
    bench += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    cli.main(bench)  # the command's own entry point, in this process
    assert "Serving Benchmark Result" in capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 24 and result["failed"] == 0
    assert result["total_input_tokens"] == 24 * 40
    assert result["total_output_tokens"] == 24 * 12, "ignore_eos: exactly the asked length"
    assert 1 <= result["max_concurrent_requests"] <= 6


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(server):
    """Last in this module: it stops the server. SIGTERM with 16 requests in flight, 8 of
    them streamed: new requests get 503, requests that can finish within --shutdown-timeout
    do, the rest end cleanly (a JSON error, or an error event and `[DONE]`); the server exits
    0 in time, with no traceback in its log and no process left behind."""
    try:
        replies: dict[int, tuple[int, str, bytes]] = {}
        threads = []
        for i in range(NUM_REQUESTS):
            long = i % 4 >= 2  # runs past the drain timeout: ended by the server
            body = {
                "prompt": f"request {i}",
                "max_tokens": 500 if long else 4,
                "n": 4 if long else 1,  # 2,000 tokens: more than the drain timeout allows
                "ignore_eos": True,
                "stream": i % 2 == 0,
            }
            thread = threading.Thread(target=send, args=(server.port, body, replies, i))
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + 60
        num_sequences = sum(4 if i % 4 >= 2 else 1 for i in range(NUM_REQUESTS))
        # All in the engine (a finished one is a short one: one sequence).
        while len(replies) + engine_sequences(server) < num_sequences:
            assert time.monotonic() < deadline, "the requests never all reached the engine"
            time.sleep(0.05)
        assert not replies.keys() & {i for i in range(NUM_REQUESTS) if i % 4 >= 2}
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        late: dict[int, tuple[int, str, bytes]] = {}
        send(server.port, {"prompt": "late", "max_tokens": 2}, late, 0)
        server.process.wait(SHUTDOWN_TIMEOUT_S + 30)
        exit_s = time.monotonic() - signalled
        for thread in threads:
            thread.join(30)
    finally:
        leftovers = server.stop(timeout_s=30)
    assert server.process.returncode == 0, server.log[-3000:]
    assert exit_s < SHUTDOWN_TIMEOUT_S + 15
    assert leftovers == [], "processes outlived the server"
    assert "Traceback" not in server.log and "Exception in ASGI" not in server.log, server.log
    status, content_type, payload = late[0]
    assert status == 503 and content_type == "application/json", payload
    assert json.loads(payload)["error"]["code"] == "shutting_down"

    assert sorted(replies) == list(range(NUM_REQUESTS))
    ended = 0
    for i, (status, content_type, payload) in sorted(replies.items()):
        if i % 2 == 0:  # a stream: its last token and [DONE], or an error event and [DONE]
            assert status == 200 and content_type.startswith("text/event-stream"), payload
            events = stream_events(payload)
            assert events[-1] == "[DONE]", payload[-300:]
            last = json.loads(events[-2])
            if "error" in last:
                ended += 1
                assert last["error"]["code"] == "shutting_down"
            else:
                assert last["choices"][0]["finish_reason"] == "length", last
                assert i % 4 < 2
        else:  # a plain request: the whole reply, or a JSON error
            assert content_type == "application/json", (status, payload)
            body = json.loads(payload)
            if status == 200:
                assert body["choices"][0]["finish_reason"] == "length"
                assert i % 4 < 2
            else:
                ended += 1
                assert status == 503 and body["error"]["code"] == "shutting_down", body
    assert ended == NUM_REQUESTS // 2  # the long ones, ended at the drain timeout
    assert "drain timeout: ended 8 request(s) still running" in server.log
