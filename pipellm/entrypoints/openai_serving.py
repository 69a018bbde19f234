"""Serves /v1/completions and /v1/chat/completions: validate, run on the engine, answer in
OpenAI's JSON, whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipellm.config import EngineConfig
from pipellm.engine.async_client import AsyncEngineClient, EngineDeadError, RequestFailedError
from pipellm.engine.prompt_check import check_prompt
from pipellm.entrypoints.json_body import free_in_pieces
from pipellm.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    OpenAIError,
)
from pipellm.entrypoints.request_prep import RequestPrep
from pipellm.entrypoints.server_limits import ServerLimits, prompt_chars_bound
from pipellm.entrypoints.server_metrics import ServerMetrics
from pipellm.entrypoints.tool_calls import ToolCalling, plan_tool_calling, template_messages
from pipellm.protocol import EngineOutput, Logprobs, one_line
from pipellm.sampling_params import SamplingParams
from pipellm.structured_outputs import (
    STRUCTURED_OUTPUT_FAILED,
    StructuredOutputsError,
    StructuredOutputsParams,
    llguidance_tokenizer,
    probe,
)
from pipellm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")
Chunk = dict[str, Any]
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request the client gave up on
PREP_THREADS = 2  # chat templating, tokenizing, constraint compiles run on these
PREP_QUEUE = 64  # jobs waiting for a prep thread before requests get 503
MAX_CHECKED_CONSTRAINTS = 256  # constraints whose probe passed, remembered (LRU)
CONSTRAINT_PARAMS = ("structured_outputs", "response_format")


class ServerShuttingDownError(RuntimeError):
    """The server's drain ran out of time: requests still running are ended."""


class OpenAIServing:
    def __init__(
        self,
        client: AsyncEngineClient,
        config: EngineConfig,
        tokenizer: Tokenizer,
        metrics: ServerMetrics,
        limits: ServerLimits,
        tool_call_parser: str | None = None,
    ) -> None:
        self.client = client
        self.tool_call_parser = tool_call_parser  # how tool_choice "auto" reads replies
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.limits = limits
        self.model_name = config.model_name
        self.max_prompt_chars = limits.max_prompt_chars or prompt_chars_bound(
            config.max_model_len, tokenizer.longest_token_chars
        )
        self.prep = RequestPrep(PREP_THREADS, PREP_QUEUE)
        self.ending = False  # the drain timed out: nothing new reaches the engine
        self._llguidance_tokenizer: Any = None  # built on the first constrained request
        # Digests of constraints that passed the probe; a failure is never remembered.
        self._checked_constraints: OrderedDict[bytes, None] = OrderedDict()

    def close(self) -> None:
        self.prep.close()

    # ---- endpoints -----------------------------------------------------------------------------

    async def completion(self, request: CompletionRequest, raw: Request) -> Response:
        self._check_request(request)
        prompt = request.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = await self._encode(prompt, "prompt", add_special_tokens=True)
        else:
            prompt_ids = prompt
        params = await self._sampling_params(
            request,
            prompt_ids,
            1 if request.echo_only else request.max_tokens,
            request.logprobs,
            request.num_prompt_logprobs,
        )
        reply = _Reply("cmpl", "text_completion", self.model_name, len(prompt_ids))
        outputs = self._generate(reply.id, prompt_ids, params)

        def choice(outs: list[EngineOutput], finished: EngineOutput | None) -> Chunk:
            generated = [] if request.echo_only else outs
            text = "".join(o.new_text for o in generated)
            pairs = _token_logprobs(generated)
            prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None)
            if request.echo:
                prompt_text = prompt if isinstance(prompt, str) else self._decode(prompt_ids)
                text = prompt_text + text
                echoed = prompt_logprobs or [None] * len(prompt_ids)
                pairs = list(zip(prompt_ids, echoed, strict=True)) + pairs
            out = {
                "index": outs[0].index if outs else 0,
                "text": text,
                "logprobs": self._completion_logprobs(pairs)
                if request.logprobs is not None
                else None,
                **_finish(finished),
            }
            if prompt_logprobs is not None and request.prompt_logprobs is not None:
                out["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_ids, prompt_logprobs)
            return out

        if request.stream:
            return _sse(reply.stream(outputs, [], choice, request.include_usage))
        outs = await _unless_disconnected(raw, _collect(outputs))
        num_tokens = 0 if request.echo_only else _num_tokens(outs)
        choices = [choice(sample, sample[-1]) for sample in _by_sample(outs, params.n)]
        return JSONResponse(reply.whole(num_tokens, choices))

    async def chat(
        self,
        request: ChatCompletionRequest,
        raw: Request,
        prepared: tuple[ToolCalling, list[int]] | None = None,
    ) -> Response:
        """`prepared`: prepare_chat's result, when the caller ran it already."""
        if prepared is None:
            prepared = await self.prep.run(self.prepare_chat, request)
        tool_calling, prompt_ids = prepared
        params = tool_calling.constrain(
            await self._sampling_params(
                request,
                prompt_ids,
                request.requested_max_tokens,
                request.num_logprobs,
                request.prompt_logprobs,
            )
        )
        object = "chat.completion.chunk" if request.stream else "chat.completion"
        reply = _Reply("chatcmpl", object, self.model_name, len(prompt_ids))
        outputs = self._generate(reply.id, prompt_ids, params)

        def logprobs(outs: list[EngineOutput]) -> Chunk | None:
            return self._chat_logprobs(outs) if params.logprobs is not None else None

        if request.stream:
            streams = [tool_calling.stream() for _ in range(params.n)]

            def delta(outs: list[EngineOutput], finished: EngineOutput | None) -> Chunk:
                stream = streams[outs[0].index]
                new = stream.feed("".join(o.new_text for o in outs), final=finished is not None)
                finish = _finish(finished)
                finish["finish_reason"] = stream.finish_reason(finish["finish_reason"])
                return {
                    "index": outs[0].index,
                    "delta": new,
                    "logprobs": logprobs(outs),
                    **finish,
                }

            roles = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                for i in range(params.n)
            ]
            return _sse(reply.stream(outputs, roles, delta, request.include_usage))
        outs = await _unless_disconnected(raw, _collect(outputs))

        def choice(sample: list[EngineOutput]) -> Chunk:
            finish = _finish(sample[-1])
            message, finish["finish_reason"] = tool_calling.message(
                "".join(o.new_text for o in sample), finish["finish_reason"]
            )
            return {
                "index": sample[0].index,
                "message": message,
                "logprobs": logprobs(sample),
                **finish,
            }

        choices = [choice(sample) for sample in _by_sample(outs, params.n)]
        body = reply.whole(_num_tokens(outs), choices)
        prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None)
        if prompt_logprobs is not None:  # vLLM puts it beside the choices in chat replies
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_ids, prompt_logprobs)
        return JSONResponse(body)

    # ---- validation ----------------------------------------------------------------------------

    def _check_request(self, request: GenerationRequest) -> None:
        if request.model is not None and request.model != self.model_name:
            raise OpenAIError(
                f"The model {request.model!r} does not exist; this server serves "
                f"{self.model_name!r} (see /v1/models).",
                status_code=404,
                param="model",
                code="model_not_found",
            )
        request.check_supported()
        self._check_stop(request)

    def _check_stop(self, request: GenerationRequest) -> None:
        """Stop strings are searched after every token, bad words tokenized in the engine
        core's loop: their number and length are capped."""
        limits = self.limits
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        lists = {"stop": stop, "bad_words": request.bad_words or []}
        for name, values in {**lists, "stop_token_ids": request.stop_token_ids or []}.items():
            if len(values) > limits.max_stop_strings:
                raise OpenAIError(
                    f"{name} has {len(values)} entries, over the limit of "
                    f"{limits.max_stop_strings} (--max-stop-strings)",
                    param=name,
                )
        for name, strings in lists.items():
            longest = max((len(s) for s in strings), default=0)
            if longest > limits.max_stop_string_chars:
                raise OpenAIError(
                    f"a string in {name} has {longest} characters, over the limit of "
                    f"{limits.max_stop_string_chars} (--max-stop-string-chars)",
                    param=name,
                )

    def prepare_chat(self, request: ChatCompletionRequest) -> tuple[ToolCalling, list[int]]:
        """Checks the request, and says how it uses its tools and its prompt's token ids: one
        prep job (it blocks), since checking the tools compiles their schemas into grammars
        and a long chat takes seconds to render."""
        self._check_request(request)
        if self.tokenizer.chat_template is None:
            # As vLLM answers: the model (e.g. a base model's GGUF) brought no template.
            raise OpenAIError(
                "this model has no chat template: start the server with --chat-template FILE "
                "(a Jinja chat template), or send a plain prompt to /v1/completions",
                param="messages",
            )
        messages: list[dict[str, Any]] = []
        try:
            tool_calling = plan_tool_calling(request, self.tool_call_parser)
            messages = template_messages(request)
            text = self.tokenizer.apply_chat_template(messages, tools=tool_calling.tools)
        except (ValueError, TypeError) as error:  # the template could not render these messages
            raise OpenAIError(
                f"cannot apply the chat template: {error}", param="messages"
            ) from error
        finally:
            # The messages are not needed past here. Freed at the request's end, on the event
            # loop, 125,000 of them held it for half a second; here they go a slice at a time.
            free_in_pieces(messages)
            free_in_pieces(request.messages)
        return tool_calling, self._tokenize(text, "messages", add_special_tokens=False)

    async def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """_tokenize off the event loop: a long prompt must not stall the other streams."""
        return await self.prep.run(self._tokenize, text, param, add_special_tokens)

    def _tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a prompt, refused before tokenizing if it cannot fit the context."""
        if len(text) > self.max_prompt_chars:
            raise OpenAIError(
                f"the {param} has {len(text)} characters, over the limit of "
                f"{self.max_prompt_chars} (--max-prompt-chars): no text that long fits this "
                f"model's maximum context length of {self.config.max_model_len} tokens",
                param=param,
            )
        try:
            return self.tokenizer.encode(text, add_special_tokens)
        except ValueError as error:
            raise OpenAIError(f"{param}: {error}", param=param) from error

    async def _sampling_params(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Checks the prompt against the vocabulary and the context; max_tokens None means
        the rest of the context. A structured-output constraint is compiled and probed on a
        prep thread within --structured-outputs-timeout; any problem with it is a 400,
        logged with its reason, before anything is scheduled."""
        limit = self.config.max_model_len
        try:
            check_prompt(prompt_ids, self.config.model_config.vocab_size, limit)
        except ValueError as error:
            raise OpenAIError(str(error), param="prompt") from None
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids)
        try:
            params = await self._checked_params(request, max_tokens, logprobs, prompt_logprobs)
        except OpenAIError as error:
            if error.param in CONSTRAINT_PARAMS:
                logger.warning("refused a structured-output constraint: %s", error.message)
            raise
        if len(prompt_ids) + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens, but you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                f"{max_tokens} for the completion); reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return params

    async def _checked_params(
        self,
        request: GenerationRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        uses_constraint = request.structured_outputs is not None or (
            request.response_format is not None and request.response_format.type != "text"
        )
        if not uses_constraint:
            return request.sampling_params(max_tokens, logprobs, prompt_logprobs)
        if self._llguidance_tokenizer is None:  # once, and outside the compile deadline
            self._llguidance_tokenizer = await self.prep.run(
                llguidance_tokenizer,
                self.tokenizer,
                self.config.model_config.vocab_size,
                self.config.model_config.eos_token_ids,
            )
        timeout_s = self.limits.structured_outputs_timeout_s
        try:
            return await self.prep.run(
                self._params_with_constraint,
                request,
                max_tokens,
                logprobs,
                prompt_logprobs,
                timeout_s=timeout_s,
            )
        except TimeoutError:
            raise OpenAIError(
                f"the structured-output constraint took over {timeout_s:g} s to compile "
                "(--structured-outputs-timeout); simplify it",
                param="structured_outputs",
                code="structured_outputs_timeout",
            ) from None

    def _params_with_constraint(
        self,
        request: GenerationRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        """On a prep thread: the sampling params, their constraint compiled and probed with
        the tokenizer (the last stage then compiles only constraints that work)."""
        params = request.sampling_params(max_tokens, logprobs, prompt_logprobs)
        constraint = params.structured_outputs
        assert isinstance(constraint, StructuredOutputsParams)
        key = hashlib.sha256(constraint.llguidance_grammar().encode()).digest()
        if key not in self._checked_constraints:
            try:
                probe(constraint, self._llguidance_tokenizer)
            except StructuredOutputsError as error:
                raise OpenAIError(
                    f"invalid structured_outputs.{error.field}: {error.reason}",
                    param="structured_outputs",
                ) from error
            self._remember_checked(key)
        return params

    def _remember_checked(self, key: bytes) -> None:
        # From prep threads: OrderedDict's single operations hold the GIL; losing an entry
        # to a race costs one more probe, nothing else.
        self._checked_constraints[key] = None
        while len(self._checked_constraints) > MAX_CHECKED_CONSTRAINTS:
            self._checked_constraints.popitem(last=False)

    # ---- running -------------------------------------------------------------------------------

    def _generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        if self.ending:
            raise _as_openai_error(ServerShuttingDownError("the server is shutting down"))
        if not self.client.is_alive:
            raise OpenAIError(
                f"the engine is not running: {one_line(self.client.dead_reason or '')}",
                status_code=500,
                type="server_error",
            )
        arrival = time.perf_counter()
        return self.metrics.track(self.client.generate(request_id, prompt_ids, params), arrival)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _completion_logprobs(self, pairs: list[tuple[int, Logprobs | None]]) -> Chunk:
        """OpenAI's completions format; an echoed prompt's first token has null logprobs."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = 0
        for token_id, entry in pairs:
            text = self._token_text(token_id)
            tokens.append(text)
            token_logprobs.append(entry[0] if entry else None)
            top_logprobs.append(self._top_by_text(entry[1]) or None if entry else None)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _top_by_text(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """{token text: logprob}; tokens that decode alike keep the best (first) logprob."""
        by_text: dict[str, float] = {}
        for token_id, logprob in top:
            by_text.setdefault(self._token_text(token_id), logprob)
        return by_text

    def _vllm_prompt_logprobs(
        self, prompt_ids: list[int], entries: list[Logprobs | None]
    ) -> list[Chunk | None]:
        """vLLM's prompt_logprobs field: per prompt token {token id: {logprob, rank,
        decoded_token}} for the token itself and the top-n (rank 1 is the likeliest; the
        prompt token's own rank is given only when it is among the top-n)."""
        result: list[Chunk | None] = []
        for token_id, entry in zip(prompt_ids, entries, strict=True):
            if entry is None:
                result.append(None)
                continue
            logprob, top = entry
            ranks = {t: rank for rank, (t, _) in enumerate(top, start=1)}
            values = {token_id: logprob, **dict(top)}
            result.append(
                {
                    str(t): {
                        "logprob": lp,
                        "rank": ranks.get(t),
                        "decoded_token": self._token_text(t),
                    }
                    for t, lp in values.items()
                }
            )
        return result

    def _chat_logprobs(self, outs: list[EngineOutput]) -> Chunk:
        def entry(token_id: int, logprob: float) -> Chunk:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
            for token_id, (logprob, top) in _token_logprobs(outs)
        ]
        return {"content": content}


class _Reply:
    """One response's id, object type and usage, whole or as a stream of chunks."""

    def __init__(self, id_prefix: str, object: str, model: str, num_prompt_tokens: int) -> None:
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.object = object
        self.model = model
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens

    def _envelope(self, choices: list[Chunk], usage: Chunk | None) -> Chunk:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def usage(self, num_tokens: int) -> Chunk:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": num_tokens,
            "total_tokens": self.num_prompt_tokens + num_tokens,
        }

    def whole(self, num_tokens: int, choices: list[Chunk]) -> Chunk:
        return self._envelope(choices, self.usage(num_tokens))

    async def stream(
        self,
        outputs: AsyncIterator[EngineOutput],
        head: list[Chunk],
        to_choice: Callable[[list[EngineOutput], EngineOutput | None], Chunk],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """One chunk per engine output, then usage if asked, then [DONE]; an engine failure
        mid-stream becomes an error event."""
        num_tokens = 0
        try:
            for choice in head:
                yield _event(self._envelope([choice], None))
            async with aclosing(outputs):
                async for out in outputs:
                    num_tokens += len(out.new_token_ids)
                    finished = out if out.finished else None
                    yield _event(self._envelope([to_choice([out], finished)], None))
            if include_usage:
                yield _event(self._envelope([], self.usage(num_tokens)))
        except (EngineDeadError, RequestFailedError, ServerShuttingDownError, ValueError) as error:
            yield _event(_as_openai_error(error).body())
        yield "data: [DONE]\n\n"


async def _collect(outputs: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    try:
        async with aclosing(outputs):
            return [out async for out in outputs]
    except (EngineDeadError, RequestFailedError, ServerShuttingDownError, ValueError) as error:
        raise _as_openai_error(error) from error


async def _unless_disconnected(raw: Request, work: Coroutine[Any, Any, T]) -> T:
    """Runs work; if the client disconnects first, cancels it, which aborts its request."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise OpenAIError("the client closed the request", status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    # The body is read already, so the next ASGI message can only be the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _as_openai_error(error: Exception) -> OpenAIError:
    if isinstance(error, EngineDeadError):
        return OpenAIError(f"the engine failed: {one_line(str(error))}", 500, "server_error")
    if isinstance(error, RequestFailedError) and str(error).startswith(STRUCTURED_OUTPUT_FAILED):
        # A constraint that failed part-way (a parser limit its first tokens did not reach):
        # the request's fault, not the engine's.
        logger.warning("a structured-output constraint failed while generating: %s", error)
        return OpenAIError(f"{error}; simplify the constraint", param="structured_outputs")
    if isinstance(error, ServerShuttingDownError):
        return OpenAIError(str(error), status_code=503, type="server_error", code="shutting_down")
    if isinstance(error, RequestFailedError):
        message = f"the engine failed this request ({error}); the server log has the details"
        return OpenAIError(message, status_code=500, type="server_error")
    return OpenAIError(str(error))


def _finish(out: EngineOutput | None) -> Chunk:
    if out is None:
        return {"finish_reason": None}
    return {"finish_reason": out.finish_reason, "stop_reason": out.stop_reason}


def _by_sample(outs: list[EngineOutput], n: int) -> list[list[EngineOutput]]:
    """A request's outputs split by sample index (each sample has at least one)."""
    samples: list[list[EngineOutput]] = [[] for _ in range(n)]
    for out in outs:
        samples[out.index].append(out)
    return samples


def _num_tokens(outs: list[EngineOutput]) -> int:
    return sum(len(o.new_token_ids) for o in outs)


def _token_logprobs(outs: list[EngineOutput]) -> list[tuple[int, Any]]:
    return [
        pair
        for out in outs
        for pair in zip(out.new_token_ids, out.new_logprobs or [], strict=False)
    ]


def _event(payload: Chunk) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")
