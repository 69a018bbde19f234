"""The messages between the engine, the executors and the stage workers, and what the engine
hands back: one module beneath all of them, so each imports the contract, never its user.

Everything here is small and picklable on purpose: it crosses process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipellm.sampling_params import SamplingParams

# A sampled token's logprob and the top-n (token_id, logprob) pairs at its position.
Logprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class ScheduledRequest:
    """One request's chunk in a micro-batch.

    Workers keep each request's tokens and block table between steps, so after the first
    time only what is new travels: the latest sampled token and any newly allocated blocks.
    """

    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache before this chunk
    num_scheduled_tokens: int
    new_token_ids: list[int]
    new_block_ids: list[int]  # the first KV-cache group's (model/cache_groups.py)
    # Workers (re)create the request's state: first schedule, or resumed after preemption.
    sampling_params: SamplingParams | None = None
    sample: bool = False  # the chunk ends at the last known token: sample the next one
    num_output_tokens: int = 0  # position of the token to sample; seeds per-token randomness
    # The other groups' new table entries, one list a group (empty without sliding windows).
    new_group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def is_new(self) -> bool:
        return self.sampling_params is not None


@dataclass
class SchedulerOutput:
    micro_batch_id: int
    requests: list[ScheduledRequest]
    # Requests finished or preempted since the last step: workers drop their state first.
    freed_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.requests)

    @property
    def num_sampled(self) -> int:
        return sum(r.sample for r in self.requests)


@dataclass
class ModelOutput:
    """The last stage's answer to one SchedulerOutput, in submission order."""

    micro_batch_id: int
    sampled_token_ids: list[int]  # one per request with `sample`, in order
    logprobs: list[Logprobs | None] | None = None  # per sampled request, if it asked
    # Requests with prompt_logprobs: request id -> (position of the first prompt token these
    # cover, one (logprob, top-n) per prompt token of the chunk).
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] | None = None
    # Per stage: (start, end) wall-clock times of this micro-batch's compute (time.time()).
    stage_times: list[tuple[float, float]] = field(default_factory=list)
    # Sampled requests whose sampling raised, by index in sampled_token_ids: why, in one line.
    failed: dict[int, str] = field(default_factory=dict)


@dataclass
class EngineOutput:
    """New tokens and text of one request since the previous step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool  # this sample is done
    index: int = 0  # which of the request's n samples
    request_finished: bool = False  # all n samples are done: the request's last output
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    new_logprobs: list[Logprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # With prompt_logprobs, on a request's first output: one per prompt token, the first None.
    prompt_logprobs: list[Logprobs | None] | None = None
    # Set with finish_reason "error": this request failed inside the engine (one line, no
    # traceback; the engine's log has it); the other requests carry on.
    error: str | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine for logs and /metrics (EngineCore.stats())."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_in_flight: int  # micro-batches submitted and not yet returned
    prompt_tokens_total: int
    generation_tokens_total: int
    # PipelineStats.summary() over a recent window: busy fractions, queue depth, sizes.
    pipeline: dict[str, float | list[float]]
    stage_busy_seconds_total: list[float]
    pipeline_active_seconds_total: float


# ---- the engine core process's pipe (engine/core_process.py) ---------------------------------
# API process -> engine core


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class StatsRequest:
    token: int  # echoed in the StatsReply, so concurrent callers get their own


@dataclass
class Shutdown:
    """Stop serving, reap the stages, exit."""


# engine core -> API process


@dataclass
class CoreReady:
    pid: int


@dataclass
class Outputs:
    outputs: list[EngineOutput]


@dataclass
class Rejected:
    """The engine refused a request before scheduling it (a ValueError: the client's fault)."""

    request_id: str
    reason: str


@dataclass
class StatsReply:
    token: int
    stats: EngineStats


@dataclass
class CoreDead:
    """The engine core failed (or failed to start); the process exits after saying so."""

    reason: str


ToCore = AddRequest | AbortRequests | StatsRequest | Shutdown
FromCore = CoreReady | Outputs | Rejected | StatsReply | CoreDead


# ---- a stage process's pipe (executor/mp.py), besides SchedulerOutput in, ModelOutput out ----


@dataclass
class StageReady:
    """The stage loaded its weights and joined its process groups."""

    memory: Any = None  # what it holds: worker/stage_memory.py's LoadedStage


@dataclass
class StageFailed:
    traceback: str  # logged by the engine; only its last line travels on to clients (one_line)


def one_line(text: str, *, last: bool = False, default: str = "unknown") -> str:
    """One line of a multi-line reason, for /health, clients and short logs (the whole text
    stays in the server log): a message's first line, or with `last` a traceback's last (the
    exception), at most 200 characters; `default` when the text is blank."""
    lines = text.strip().splitlines()
    if not lines:
        return default
    return (lines[-1] if last else lines[0])[:200]
