"""What the engine hands back: per-step deltas (for streaming) and whole results (offline)."""

from __future__ import annotations

from dataclasses import dataclass, field

Logprobs = tuple[float, list[tuple[int, float]]]  # (sampled token's logprob, top-n pairs)


@dataclass
class EngineOutput:
    """New tokens and text of one request since the previous step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[Logprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # With prompt_logprobs, on a request's first output: one per prompt token, the first None.
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None
