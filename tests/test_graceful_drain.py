"""SIGTERM with 16 requests in flight, 8 of them streamed, against `pipellm serve -pp 2`: new
requests get 503, requests that can finish within --shutdown-timeout do, the rest end cleanly
(a JSON error, or an error event and `[DONE]`); the server exits 0 in time, with no traceback
in its log and no process left behind."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import pytest

from pipellm.testing.server_process import ServerProcess
from tests.checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(180)

SHUTDOWN_TIMEOUT_S = 1.0
NUM_REQUESTS = 16  # half streamed; in each half, half short enough to finish in the drain


def send(port: int, body: dict, replies: dict[int, tuple[int, str, bytes]], key: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = json.dumps(body)
        headers = {"Content-Type": "application/json"}
        connection.request("POST", "/v1/completions", data, headers)
        response = connection.getresponse()
        content_type = response.getheader("content-type", "")
        replies[key] = (response.status, content_type, response.read())
    except (http.client.HTTPException, OSError) as error:  # cut off: what the drain prevents
        replies[key] = (0, "", repr(error).encode())
    finally:
        connection.close()


def stream_events(payload: bytes) -> list[str]:
    return [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny")
    flags = ["-pp", "2", "--kv-cache-memory", str(16 * 2**20)]
    flags += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    server = ServerProcess([str(checkpoint), *flags], tmp_path / "log")
    server.start()
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
        time.sleep(0.5)  # all sent and running
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
