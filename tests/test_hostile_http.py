"""`pipellm serve -pp 2` against a hostile client: the cases a probe broke, the request limits,
and a fuzz run from the server's own OpenAPI schema. Whatever is sent: never a 5xx, never a
traceback in a body, and the server still answers a normal chat afterwards."""

from __future__ import annotations

import json
import socket
import time

import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from benchmarks.openapi_checks import EXPLAINED, failed_checks
from pipellm.testing.server_process import ServerProcess
from tests.checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(180)

BODY_LIMIT = 100_000
READ_TIMEOUT_S = 1.0
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 16
FLAGS = [
    "-pp",
    "2",
    "--max-model-len",  # keeps the fuzz run's generations short
    "128",
    "--kv-cache-memory",
    str(16 * 2**20),
    "--max-request-body-bytes",
    str(BODY_LIMIT),
    "--request-read-timeout",
    str(READ_TIMEOUT_S),
    "--max-stop-strings",
    str(MAX_STOP_STRINGS),
    "--max-stop-string-chars",
    str(MAX_STOP_CHARS),
]
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    process = ServerProcess([str(checkpoint), *FLAGS], tmp_path_factory.mktemp("log") / "log")
    with process:
        yield process
        assert process.stop(timeout_s=30) == [], "processes outlived the server"
        assert process.process.returncode == 0, process.log[-3000:]


def raw_http(server: ServerProcess, data: bytes, wait_s: float = 15.0) -> tuple[int, bytes]:
    """Sends raw bytes, reads until the server closes or wait_s passes; (status, body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as connection:
        connection.sendall(data)
        reply = b""
        try:
            while chunk := connection.recv(65536):
                reply += chunk
                head, _, body = reply.partition(b"\r\n\r\n")
                length = [
                    line
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ]
                if length and len(body) >= int(length[0].split(b":")[1]):
                    break
        except TimeoutError:
            pass
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else 0
    return status, body


def post(
    server: ServerProcess, path: str, body: bytes | dict, extra_headers: str = ""
) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra_headers}\r\n"
    )
    return raw_http(server, head.encode() + data)


def assert_error(status: int, body: bytes, expected: int, words: str) -> None:
    assert status == expected, body[:500]
    error = json.loads(body)["error"]
    assert words in error["message"], error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def assert_serves_a_chat(server: ServerProcess) -> None:
    status, body = post(server, CHAT, {"messages": HI, "max_tokens": 3, "ignore_eos": True})
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 3
    assert (
        raw_http(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0] == 200
    )


# ---- the cases the probe broke ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**63 - 1, 2**70, -1])
def test_any_integer_seed_is_served(server, seed):
    body = {"prompt": "hi", "max_tokens": 2, "seed": seed, "ignore_eos": True}
    first, second = post(server, COMPLETIONS, body), post(server, COMPLETIONS, body)
    assert first[0] == 200, first[1]
    assert json.loads(first[1])["choices"][0]["text"] == json.loads(second[1])["choices"][0]["text"]
    assert_serves_a_chat(server)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, b'{"prompt": "\\ud800 hi", "max_tokens": 2}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "a \\udfff"}], "max_tokens": 2}'),
    ],
)
def test_lone_surrogate_is_a_400(server, path, body):
    status, reply = post(server, path, body)
    assert_error(status, reply, 400, "lone surrogate U+D")


LIMITS = [
    # (body, status, words naming the limit)
    ({"prompt": "x" * (BODY_LIMIT + 1)}, 413, "--max-request-body-bytes"),
    ({"prompt": "hi", "stop": ["a"] * 10_000}, 400, "--max-stop-strings"),
    (
        {"prompt": "hi", "stop": [str(i) for i in range(MAX_STOP_STRINGS + 1)]},
        400,
        "--max-stop-strings",
    ),
    (
        {"prompt": "hi", "stop_token_ids": list(range(MAX_STOP_STRINGS + 1))},
        400,
        "--max-stop-strings",
    ),
    ({"prompt": "hi", "stop": "s" * (MAX_STOP_CHARS + 1)}, 400, "--max-stop-string-chars"),
    ({"prompt": "long " * 19_000}, 400, "--max-prompt-chars"),
]


@pytest.mark.parametrize(("body", "status", "words"), LIMITS)
def test_limits_refuse_with_a_4xx_naming_them(server, body, status, words):
    assert_error(*post(server, COMPLETIONS, body), status, words)


def test_chunked_body_over_the_limit_is_a_413(server):
    chunk = b"x" * 40_000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    assert_error(*raw_http(server, head + chunks), 413, "--max-request-body-bytes")


@pytest.mark.parametrize(
    ("data", "part"),
    [
        (b"GET /health\r\n", "headers"),  # a bare HTTP/0.9 line
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le", "headers"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}", "body"),
    ],
)
def test_slow_clients_get_408_after_the_read_timeout(server, data, part):
    started = time.monotonic()
    status, body = raw_http(server, data)
    assert_error(status, body, 408, f"request {part} did not arrive within 1 s")
    assert time.monotonic() - started < 10  # not held open


def test_nothing_listens_beyond_loopback(server):
    processes = [psutil.Process(server.process.pid)]
    processes += processes[0].children(recursive=True)
    listening = [
        c.laddr
        for p in processes
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert len(listening) >= 2  # the HTTP port and stage 0's rendezvous store
    assert {address.ip for address in listening} <= {"127.0.0.1", "::1"}, listening


def test_no_traceback_in_any_error_body(server):
    replies = [post(server, COMPLETIONS, b'{"prompt": "\\ud800"}'), post(server, COMPLETIONS, b"[")]
    replies.append(post(server, COMPLETIONS, {"prompt": [1] * 10**4}))
    for status, body in replies:
        assert 400 <= status < 500
        assert b"Traceback" not in body and b'File "' not in body
    assert_serves_a_chat(server)


# ---- fuzzing from the server's own OpenAPI schema -----------------------------------------------

FUZZ_CASES = {"POST": 40, "GET": 5}  # per operation; bounded so the run stays short


def test_fuzz_from_the_openapi_schema_never_gets_a_5xx(server):
    """Bodies that fit the schema (positive) and bodies that break it (negative)."""
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    tried: list[str] = []
    server_errors: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        cases = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE),
            operation.as_strategy(GenerationMode.NEGATIVE),
        )

        @given(case=cases)
        @settings(
            max_examples=FUZZ_CASES[operation.method.upper()],
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            response = case.call(base_url=server.base_url, timeout=60)
            tried.append(case.operation.label)
            text = response.text
            if response.status_code >= 500 or "Traceback" in text:
                server_errors.append(f"{response.status_code} {case.as_curl_command()}: {text}")

        run()
    print(f"fuzz: {len(tried)} cases, {len(server_errors)} with a 5xx or a traceback")
    assert len(tried) >= 80
    assert server_errors == []
    assert_serves_a_chat(server)


def test_every_openapi_check_fails_only_as_documented(server):
    """schemathesis's own run with `--checks all` (one seed here; benchmarks/openapi_checks.py
    runs seeds 1-3 on the built-in model): no 5xx, no error, and no failed check but those
    docs/reliability.md explains."""
    result = failed_checks(server.base_url, seed=1, examples=8, api_key=None)
    assert result["complete"] and not result["errors"], result["output"][-3000:]
    assert result["operations"]["tested"] == result["operations"]["total"] >= 6
    failed = {failure["code"] for failure in result["failures"]}
    assert failed <= EXPLAINED, result["output"][-5000:]
