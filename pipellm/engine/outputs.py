"""What the offline API hands back: whole results (the engine's per-step deltas are
protocol.EngineOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipellm.protocol import Logprobs


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
