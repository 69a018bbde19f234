"""What the scheduler sends to every pipeline stage each step: small and picklable on purpose."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipellm.sampling_params import SamplingParams


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
    new_block_ids: list[int]
    # Workers (re)create the request's state: first schedule, or resumed after preemption.
    sampling_params: SamplingParams | None = None
    sample: bool = False  # the chunk ends at the last known token: sample the next one
    num_output_tokens: int = 0  # position of the token to sample; seeds per-token randomness

    @property
    def is_new(self) -> bool:
        return self.sampling_params is not None


@dataclass
class SchedulerOutput:
    step_id: int
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

    step_id: int
    sampled_token_ids: list[int]  # one per request with `sample`, in order
    # Per sampled request: (sampled token's logprob, [(token_id, logprob), ...]) or None.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # Requests with prompt_logprobs: request id -> (position of the first prompt token these
    # cover, one (logprob, top-n) per prompt token of the chunk).
    prompt_logprobs: dict[str, tuple[int, list[tuple[float, list[tuple[int, float]]]]]] | None = (
        None
    )
    # Per stage: (start, end) wall-clock times of this micro-batch's compute (time.time()).
    stage_times: list[tuple[float, float]] = field(default_factory=list)
