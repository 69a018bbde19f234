"""Request bodies of the OpenAI API (completions, chat) and the OpenAI error shape.

Fields the engine cannot honour yet are accepted by the model so that the error can name
them, then rejected with a 400 that says what to do instead.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipellm.sampling_params import SamplingParams
from pipellm.structured_outputs import (
    CONSTRAINTS,
    StructuredOutputsError,
    StructuredOutputsParams,
)


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status_code, self.type = message, status_code, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every 4xx and 5xx of the server has this body."""

    error: ErrorDetail


class StreamOptions(BaseModel):
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra field (StructuredOutputsParams): set one of json,
    regex, choice, grammar or json_object."""

    model_config = ConfigDict(extra="ignore")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text", "json_object" or "json_schema"."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(BaseModel):
    """What completions and chat share: model, sampling, stopping, streaming."""

    # Unknown fields are ignored, as OpenAI's own API does.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    repetition_penalty: float | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Raises OpenAIError(400) for options this server does not implement."""
        if self.stream_options is not None and not self.stream:
            _unsupported("stream_options", "{...}", "stream_options needs stream=true")

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's SamplingParams; raises OpenAIError(400) naming a bad value."""
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                n=self.n,
                seed=self.seed,
                stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=self._logit_bias(),
                bad_words=self.bad_words or [],
                structured_outputs=self._structured_outputs(),
                **{name: value for name, value in optional.items() if value is not None},
            )
        except ValueError as error:
            raise OpenAIError(str(error)) from error

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of structured_outputs or response_format, as vLLM merges them:
        response_format sets the constraint, structured_outputs may add its options."""
        given = self.structured_outputs
        fields = given.model_dump(by_alias=True) if given is not None else {}
        param = "structured_outputs"
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            param = "response_format"
            if any(fields.get(name) not in (None, False) for name in CONSTRAINTS):
                raise OpenAIError(
                    "response_format and structured_outputs both set a constraint; give it "
                    "in one of them",
                    param=param,
                )
            if response_format.type == "json_object":
                fields["json_object"] = True
            elif response_format.type == "json_schema":
                json_schema = response_format.json_schema
                if json_schema is None or json_schema.schema_ is None:
                    raise OpenAIError(
                        "response_format of type json_schema needs json_schema.schema: the "
                        "JSON schema the reply must follow",
                        param=param,
                    )
                fields["json"] = json_schema.schema_
            else:
                _unsupported(
                    "response_format.type",
                    response_format.type,
                    'use "text", "json_object" or "json_schema"',
                )
        if not fields:
            return None
        try:
            return StructuredOutputsParams(**fields)
        except StructuredOutputsError as error:
            where = "response_format.json_schema.schema" if param == "response_format" else None
            name = where or f"structured_outputs.{error.field}"
            raise OpenAIError(f"invalid {name}: {error.reason}", param=param) from error
        except ValueError as error:
            raise OpenAIError(str(error), param=param) from error

    def _logit_bias(self) -> dict[int, float] | None:
        """Token-id keys as ints; values clamped to OpenAI's [-100, 100], as vLLM does."""
        if not self.logit_bias:
            return None
        try:
            return {int(t): min(100.0, max(-100.0, b)) for t, b in self.logit_bias.items()}
        except ValueError as error:
            raise OpenAIError(
                f"logit_bias keys must be token ids written as integers: {error}",
                param="logit_bias",
            ) from error

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            # vLLM V1 dropped best_of too: rank n samples by their logprobs instead.
            _unsupported("best_of", self.best_of, "best_of must equal n; use n and logprobs")
        if self.echo and self.stream:
            _unsupported("echo", True, "echo needs stream=false")
        if self.max_tokens == 0 and not self.echo:
            _unsupported("max_tokens", 0, "max_tokens=0 needs echo=true (prompt logprobs only)")
        if self.suffix:
            _unsupported("suffix", "...", "suffix (insertion) is not supported")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs, nothing generated (vLLM runs
        one token and drops it, and so do we)."""
        return self.echo and self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's prompt_logprobs, or with echo the completions' logprobs count."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request, as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise OpenAIError(
                    f"prompt holds {len(prompt)} prompts; only one prompt per request is "
                    "supported, send one request per prompt",
                    param="prompt",
                )
            prompt = prompt[0]
        return prompt  # an empty one fails check_prompt, as offline


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. tool fields some templates read

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The message content as plain text; only text parts are supported."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(
                    f"content part of type {part.type!r} is not supported; only text parts",
                    param="messages",
                )
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling: kept as sent (the chat template renders them), checked by tool_calls.py.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            _unsupported("top_logprobs", self.top_logprobs, "top_logprobs needs logprobs=true")

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template expects it: role and text content."""
        return [{**m.model_dump(exclude_none=True), "content": m.text()} for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _unsupported(name: str, value: object, fix: str) -> None:
    raise OpenAIError(f"unsupported parameter {name}={value!r}: {fix}", param=name)
