"""`pipellm serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the engine
core, which runs in its own process.

Startup order: validate the config, take the port, start the engine core (loading the model
while this process loads the tokenizer), then serve. SIGINT and SIGTERM drain the server
(pipellm/entrypoints/graceful_drain.py) and reap the engine core and its pipeline stages on
every path.
"""

from __future__ import annotations

import argparse
import gc
import hmac
import json
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pipellm import __version__
from pipellm.config import EngineConfig
from pipellm.engine.async_client import AsyncEngineClient, EngineDeadError
from pipellm.engine.core_process import CoreProcess
from pipellm.entrypoints.engine_args import engine_config_from_args
from pipellm.entrypoints.graceful_drain import DrainGate, DrainingServer, DrainState
from pipellm.entrypoints.json_body import collection_paused, free_in_pieces, loads_in_pieces
from pipellm.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorResponse,
    OpenAIError,
    error_body,
)
from pipellm.entrypoints.openai_serving import (
    OpenAIServing,
    ServerShuttingDownError,
    one_line,
)
from pipellm.entrypoints.server_limits import BodyLimits, ServerLimits, header_timeout_protocol
from pipellm.entrypoints.server_metrics import ServerMetrics
from pipellm.entrypoints.tool_calls import ToolCalling
from pipellm.entrypoints.tool_parsers import resolve_tool_call_parser
from pipellm.text.chat_template import read_chat_template
from pipellm.text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

API_KEY_ENV = "PIPELLM_API_KEY"
GRACEFUL_SHUTDOWN_S = 5  # after the drain: what uvicorn still waits for before cancelling
ENGINE_DEAD_EXIT_CODE = 1
PARSE_ON_LOOP_BYTES = 64 * 1024  # smaller request bodies are parsed at once, without a thread hop
ModelT = TypeVar("ModelT", bound=BaseModel)
MESSAGES_PER_BATCH = 1000  # chat messages validated per call (each call holds the GIL)
_CHAT_MESSAGES = TypeAdapter(list[ChatMessage])

# What a field of several accepted shapes must look like (pydantic would list each shape).
UNION_HINTS = {
    "prompt": "give text, a list of token ids, or a list holding one of those",
    "stop": "give a string or a list of strings",
    "tool_choice": 'give "none", "auto", "required" or {"type": "function", "function": '
    '{"name": NAME}}',
}


# Every route may answer these besides its success; declared in the OpenAPI schema (in OpenAI's
# error shape), where FastAPI would otherwise promise a 422 the server never sends.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "model": ErrorResponse}
    for status, description in (
        (400, "invalid request"),
        (401, "missing or wrong API key (when the server requires one)"),
        (404, "unknown model or path"),
        (405, "method not allowed (the Allow header lists the allowed ones)"),
        (408, "the request's headers or body came too slowly"),
        (413, "request body too large"),
        (499, "the client closed the request"),
        (500, "the engine failed"),
        (503, "shutting down, busy, or the engine is not running"),
    )
}
router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/health")
async def health(request: Request) -> Response:
    client: AsyncEngineClient = request.app.state.client
    if client.is_alive:
        return JSONResponse({"status": "ok"})
    reason = one_line(client.dead_reason or "the engine core process is not running")
    return JSONResponse(error_body(reason, "server_error"), status_code=503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}},
)
async def metrics(request: Request) -> Response:
    try:
        stats = await request.app.state.client.stats()
    except (EngineDeadError, TimeoutError):
        stats = None  # latency histograms still answer; engine gauges are left out
    body = request.app.state.metrics.render(stats)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    config: EngineConfig = request.app.state.config
    card = {
        "id": config.model_name,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "pipellm",
        "root": config.model_name,  # not the weights' path on this host
        "max_model_len": config.max_model_len,
    }
    return {"object": "list", "data": [card]}


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its body itself (_parse_body); the
    model's schema is added to the components by _openapi."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@router.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
async def completions(request: Request) -> Response:
    body = await _parse_body(request, CompletionRequest)
    return await request.app.state.serving.completion(body, request)


@router.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    serving: OpenAIServing = request.app.state.serving
    data = await request.body()
    if len(data) <= PARSE_ON_LOOP_BYTES:
        return await serving.chat(_validate_body(ChatCompletionRequest, data), request)
    body, prepared = await serving.prep.run(_parse_and_prepare_chat, serving, data)
    return await serving.chat(body, request, prepared)


def _parse_and_prepare_chat(
    serving: OpenAIServing, data: bytes
) -> tuple[ChatCompletionRequest, tuple[ToolCalling, list[int]]]:
    """A large chat body's whole preparation in one prep job, the garbage collector held off
    until the messages are freed (json_body.py)."""
    with collection_paused():
        body = _validate_body(ChatCompletionRequest, data)
        return body, serving.prepare_chat(body)


async def _parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """The request body as `model`, as FastAPI would parse it, but a large one off the event
    loop: a 4 MB body of 100,000 chat messages takes seconds to parse and validate."""
    data = await request.body()  # already read whole, under the size limit, by BodyLimits
    if len(data) <= PARSE_ON_LOOP_BYTES:
        return _validate_body(model, data)
    return await request.app.state.serving.prep.run(_validate_body, model, data)


def _validate_body(model: type[ModelT], data: bytes) -> ModelT:
    """Raises RequestValidationError in FastAPI's form, which _validation_error answers. A body
    too large to parse on the event loop is parsed in pieces (json_body.py): this runs on a
    prep thread then, and one json.loads would still hold the GIL, and so the loop."""
    try:
        if len(data) <= PARSE_ON_LOOP_BYTES:
            value = json.loads(data) if data else None
        else:
            value = loads_in_pieces(data)
    except json.JSONDecodeError as error:
        problem = {"type": "json_invalid", "loc": ("body", error.pos), "msg": "JSON decode error"}
        raise RequestValidationError([{**problem, "ctx": {"error": error.msg}}]) from None
    except UnicodeDecodeError as error:
        problem = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}
        raise RequestValidationError([{**problem, "ctx": {"error": str(error)}}]) from None
    try:
        if model is ChatCompletionRequest and _is_long_chat(value):
            return _validate_long_chat(value)  # type: ignore[return-value]
        return model.model_validate(value)
    except ValidationError as error:
        problems = [{**item, "loc": ("body", *item["loc"])} for item in error.errors()]
        raise RequestValidationError(problems) from None


def _is_long_chat(value: object) -> bool:
    return isinstance(value, dict) and len(value.get("messages") or ()) > MESSAGES_PER_BATCH


def _validate_long_chat(value: dict[str, Any]) -> ChatCompletionRequest:
    """A chat of many messages validated a batch at a time: pydantic holds the GIL for a whole
    call, and 125,000 messages in one call would stall the event loop for a second."""
    messages = value["messages"]
    try:
        request = ChatCompletionRequest.model_validate(
            {**value, "messages": messages[:MESSAGES_PER_BATCH]}
        )
        for start in range(MESSAGES_PER_BATCH, len(messages), MESSAGES_PER_BATCH):
            batch = messages[start : start + MESSAGES_PER_BATCH]
            try:
                request.messages += _CHAT_MESSAGES.validate_python(batch)
            except ValidationError as error:
                problems = [
                    {**item, "loc": ("body", "messages", start + item["loc"][0], *item["loc"][1:])}
                    for item in error.errors()
                ]
                raise RequestValidationError(problems) from None
    finally:
        free_in_pieces(messages)  # the parsed JSON, freed at once, would hold the GIL a while
    return request


# Besides /v1: the API's description, which names every route and field.
DOC_PATHS = ("/docs", "/redoc", "/openapi.json")


class BearerAuth:
    """Requires `Authorization: Bearer <key>` on /v1/* and the API docs; plain ASGI so streams
    pass untouched. /health, /version and /metrics stay open for probes and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path.startswith(DOC_PATHS)):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing or wrong API key: send the header 'Authorization: Bearer KEY'"
                body = error_body(message, "invalid_request_error", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    core: CoreProcess,
    config: EngineConfig,
    tokenizer: Tokenizer,
    api_key: str | None,
    limits: ServerLimits,
    drain: DrainState,
    on_engine_dead: Callable[[], None] = lambda: None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app; its lifespan connects to `core`, which must be ready. on_engine_dead
    runs (on the event loop) once the engine core has died; `drain` is the graceful drain's
    state (its gate is the outermost middleware); tool_call_parser reads tool_choice "auto"
    (None: refused)."""
    server_metrics = ServerMetrics(config.model_name, config.pipeline_parallel_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # As vLLM's API server does: the startup heap (torch, the tokenizer, FastAPI) moves to
        # the permanent generation, so a full collection no longer walks it. Set off by a
        # large request's allocations, one took over a second, holding the GIL and the loop.
        gc.collect()
        gc.freeze()
        client = AsyncEngineClient(core, on_dead=on_engine_dead)
        app.state.client = client
        app.state.serving = OpenAIServing(
            client, config, tokenizer, server_metrics, limits, tool_call_parser
        )
        yield
        app.state.serving.close()
        client.close()

    app = FastAPI(title="pipellm", version=__version__, lifespan=lifespan)
    app.state.config = config
    app.state.metrics = server_metrics
    app.state.started = int(time.time())
    app.include_router(router)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(BodyLimits, limits=limits)
    if api_key:  # a client without the key gets no further, not even its body read
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(DrainGate, state=drain)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def end_requests(app: FastAPI) -> int:
    """Ends the requests still running when the drain times out (see graceful_drain)."""
    serving: OpenAIServing = app.state.serving
    serving.ending = True  # those still being prepared are refused before they start
    error = ServerShuttingDownError(
        "the server is shutting down and its drain timeout (--shutdown-timeout) passed "
        "before this request finished"
    )
    return app.state.client.end_requests(error)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with the request bodies of the routes that parse their own, and
    without the 422 FastAPI declares for a body: this server answers a bad body with 400
    (_validation_error), declared with the other errors."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in (CompletionRequest, ChatCompletionRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema


async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """400 naming each bad field once (pydantic reports every member of a union)."""
    problems: dict[str, str] = {}
    for item in error.errors():
        loc = [str(part) for part in item["loc"][1:]]  # loc[0] is "body"
        if item["type"] == "json_invalid":
            detail = item.get("ctx", {}).get("error", item["msg"])
            where = f" at character {loc[0]}" if loc else ""
            problems = {"body": f"the request body is not valid JSON ({detail}{where})"}
            break
        if not loc:
            problems["body"] = "the request needs a JSON object body"
        elif len(loc) > 1 and loc[0] in UNION_HINTS:
            problems.setdefault(loc[0], f"{loc[0]}: {UNION_HINTS[loc[0]]}")
        else:
            problems.setdefault(loc[0], f"{'.'.join(loc)}: {item['msg']}")
    message = "invalid request: " + "; ".join(problems.values())
    param = next(iter(problems), None)
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    message = f"{error.detail}: {request.method} {request.url.path}"
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    # Starlette's 405 carries the Allow header (RFC 9110 requires it).
    body = error_body(message, kind)
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    # A bug, not the client's fault; uvicorn logs the traceback, the client never sees it.
    message = f"internal error ({type(error).__name__}); the server log has the details"
    return JSONResponse(error_body(message, "server_error"), status_code=500)


# ---- running the server ------------------------------------------------------------------------


def run_server(args: argparse.Namespace) -> int:
    """`pipellm serve`: returns the exit status: 0 after a graceful stop (SIGINT or SIGTERM),
    ENGINE_DEAD_EXIT_CODE soon after the engine core died.

    NOTE: a dead engine cannot recover in place (its stages' state is gone), so the server
    stops rather than answer 503 forever: in-flight requests get their error, then the
    process exits non-zero for systemd or Kubernetes to restart it, as vLLM's API server does.
    """
    config = engine_config_from_args(args)  # a bad setting fails here, before any process
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    limits = ServerLimits.from_args(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    sock = _listen(args.host, args.port)
    # SIGTERM stops the server the way Ctrl-C does, so the finally below always runs.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    core = CoreProcess(config)
    try:
        tokenizer = load_tokenizer(config.tokenizer_source)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        tool_call_parser = resolve_tool_call_parser(args.tool_call_parser, tokenizer.chat_template)
        logger.info("tool calls: %s format", tool_call_parser or "no known")
        core.wait_ready()
        logger.info("engine core ready (pid %d)", core.pid)
        host, port = sock.getsockname()[:2]
        logger.info(
            "listening on http://%s:%d (model %s, %d pipeline stage(s), API key %s)",
            host,
            port,
            config.model_name,
            config.pipeline_parallel_size,
            "required" if api_key else "off",
        )
        engine_died = False

        def stop_serving() -> None:
            nonlocal engine_died
            engine_died = True
            logger.error("the engine core is dead: stopping the server (exit code %d)", 1)
            server.should_exit = True

        drain = DrainState()
        app = build_app(
            core,
            config,
            tokenizer,
            api_key,
            limits,
            drain,
            on_engine_dead=stop_serving,
            tool_call_parser=tool_call_parser,
        )
        uvicorn_config = uvicorn.Config(
            app,
            log_config=None,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            http=header_timeout_protocol(limits.request_read_timeout_s),
        )
        server = DrainingServer(
            uvicorn_config, drain, limits.shutdown_timeout_s, lambda: end_requests(app)
        )
        server.run(sockets=[sock])
        if engine_died:
            return ENGINE_DEAD_EXIT_CODE
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C must not leave the engine core orphaned half-way.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logger.info("stopping the engine core")
        core.shutdown()
        sock.close()
    logger.info("server stopped")
    return 0


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _listen(host: str, port: int) -> socket.socket:
    """Takes the port before the model loads, so a busy port fails at once."""
    if not 0 <= port <= 65535:
        raise ValueError(f"invalid --port {port}: use 0-65535 (0 picks a free port)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} ({error.strerror or error}); "
            "pick another --port or --host"
        ) from error
    return sock
