"""Limits that bound the work one HTTP client can cause before any model work starts.

Each is a `pipellm serve` flag with a default; each refusal is a 4xx in OpenAI's error shape
whose message names the flag. What they guard against:
- a huge body read and parsed in full (--max-request-body-bytes: 413, from Content-Length
  before reading, or while reading a chunked body);
- a client that never finishes its request, holding a connection and its task forever (the
  "slowloris" attack): the headers and then the body must each arrive within
  --request-read-timeout (408);
- stop strings that are many or long, searched after every token, and bad words, tokenized
  in the engine core's loop (--max-stop-strings, --max-stop-string-chars);
- a prompt so long that tokenizing it costs seconds of CPU before the context-length check
  (--max-prompt-chars, checked before tokenizing; see `prompt_chars_bound`);
- a structured-output constraint whose compilation takes long (--structured-outputs-timeout:
  400; its size limits are in pipellm/structured_outputs.py).
And one that bounds a stop: --shutdown-timeout, how long in-flight requests may take to finish
once SIGTERM or SIGINT came (pipellm/entrypoints/graceful_drain.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass
from typing import Any

import h11
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipellm.entrypoints.openai_protocol import error_body


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 4 * 2**20
    request_read_timeout_s: float = 30.0
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_prompt_chars: int = 0  # 0: the bound implied by the context length (prompt_chars_bound)
    structured_outputs_timeout_s: float = 10.0
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for flag, value, minimum in (
            ("--max-request-body-bytes", self.max_request_body_bytes, 1),
            ("--request-read-timeout", self.request_read_timeout_s, 0.001),
            ("--max-stop-strings", self.max_stop_strings, 0),
            ("--max-stop-string-chars", self.max_stop_string_chars, 1),
            ("--max-prompt-chars", self.max_prompt_chars, 0),
            ("--structured-outputs-timeout", self.structured_outputs_timeout_s, 0.001),
            ("--shutdown-timeout", self.shutdown_timeout_s, 0),
        ):
            if not value >= minimum:
                raise ValueError(f"invalid {flag} {value}: use a value >= {minimum}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(
            max_request_body_bytes=args.max_request_body_bytes,
            request_read_timeout_s=args.request_read_timeout,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_prompt_chars=args.max_prompt_chars,
            structured_outputs_timeout_s=args.structured_outputs_timeout,
            shutdown_timeout_s=args.shutdown_timeout,
        )


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    defaults = ServerLimits()
    g = parser.add_argument_group("request limits (each refusal is a 4xx naming its flag)")
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=defaults.max_request_body_bytes,
        help="largest request body accepted (413 above it); default %(default)s",
    )
    g.add_argument(
        "--request-read-timeout",
        type=float,
        default=defaults.request_read_timeout_s,
        help="seconds a client has to send a request's headers, and then its body (408 after, "
        "against slowloris clients); default %(default)s",
    )
    g.add_argument(
        "--max-stop-strings",
        type=int,
        default=defaults.max_stop_strings,
        help="most stop strings (and stop_token_ids, bad_words) per request; default %(default)s",
    )
    g.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=defaults.max_stop_string_chars,
        help="longest stop string (or bad word) in characters; default %(default)s",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=int,
        default=defaults.max_prompt_chars,
        help="longest text prompt (or rendered chat) in characters, checked before tokenizing; "
        "default 0: max_model_len times the longest token of the vocabulary, which no prompt "
        "that fits the context can exceed",
    )
    g.add_argument(
        "--structured-outputs-timeout",
        type=float,
        default=defaults.structured_outputs_timeout_s,
        help="seconds a request's structured-output constraint may take to compile and check "
        "(400 after); default %(default)s",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout_s,
        help="on SIGTERM or SIGINT, seconds in-flight requests get to finish before they are "
        "ended with an error (new requests get 503 meanwhile); default %(default)s",
    )


def prompt_chars_bound(max_model_len: int, longest_token_chars: int) -> int:
    """The characters of the longest text that can still fit max_model_len tokens.

    A token decodes to at most longest_token_chars characters, so a text longer than
    max_model_len * longest_token_chars has at least max_model_len tokens: it cannot fit,
    and rejecting it without tokenizing turns away no prompt that would have been served.
    """
    return max_model_len * max(1, longest_token_chars)


# ---- the request body: size and read time -------------------------------------------------------


class BodyLimits:
    """ASGI middleware: reads the whole body under the size and time limits, then hands it to
    the app. Refuses with 413 or 408 itself, so nothing past it sees an oversized body."""

    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_request_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(int(declared), limit)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.limits.request_read_timeout_s
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, remaining))
            except TimeoutError:
                await _timed_out("body", self.limits.request_read_timeout_s)(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(size, limit)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body, only the disconnect can come

        await self.app(scope, replay, send)


def _too_large(size: int, limit: int) -> JSONResponse:
    message = (
        f"the request body has {'at least ' if size > limit else ''}{size} bytes, over the "
        f"limit of {limit} (--max-request-body-bytes)"
    )
    body = error_body(message, "invalid_request_error", code="request_too_large")
    return JSONResponse(body, status_code=413)


def _timed_out(part: str, timeout_s: float) -> JSONResponse:
    return JSONResponse(_timeout_body(part, timeout_s), status_code=408)


def _timeout_body(part: str, timeout_s: float) -> dict[str, Any]:
    message = f"the request {part} did not arrive within {timeout_s:g} s (--request-read-timeout)"
    return error_body(message, "invalid_request_error", code="request_timeout")


# ---- the request headers: read time ---------------------------------------------------------


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a deadline on each request's headers.

    uvicorn bounds only the idle time between requests (keep-alive); a client that sends a
    partial request line, a bare HTTP/0.9 line or headers one byte at a time is otherwise
    held open forever. Here, from a connection's start (or the first byte of its next
    request), the headers must be complete within timeout_s, else 408 and close.
    """

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on a kept-alive connection has begun
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # headers complete (or the connection failed): the app's turn

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._on_header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            body = json.dumps(_timeout_body("headers", timeout_s)).encode()
            head = (
                "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            self.transport.close()

    return HeaderTimeoutProtocol
