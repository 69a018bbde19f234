"""A generation request as the scheduler sees it: tokens, progress, blocks and status."""

from __future__ import annotations

import enum

from pipellm.protocol import Logprobs
from pipellm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One sequence. `num_computed_tokens` advances when a chunk is *scheduled*, so a request
    in flight already counts the tokens its micro-batch is computing."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        parent_id: str | None = None,
        index: int = 0,
        fork_from: Request | None = None,
    ) -> None:
        self.request_id = request_id
        # One of n parallel samples: the API's request id and this sample's index; the samples
        # after the first take the first one's full prompt blocks (`fork_from`) instead of
        # computing the prompt again.
        self.parent_id = request_id if parent_id is None else parent_id
        self.index = index
        self.fork_from = fork_from
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admit)
        # One block table per KV-cache group (model/cache_groups.py); none before allocation.
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[int] = []  # hash chain of this request's full blocks
        self.num_in_flight = 0  # in-flight micro-batches holding a chunk of this request
        self.num_tokens_sent = 0  # how many of all_token_ids the stage workers already hold
        self.num_blocks_sent = 0  # likewise for each block table's entries
        self.num_preemptions = 0
        # Written only by Scheduler.stop_request, the one place a request ends.
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.stop_reason: int | str | None = None
        # With prompt_logprobs: one entry per prompt token, filled as its chunks return.
        self.prompt_logprobs: list[Logprobs | None] | None = (
            [None] * len(prompt_token_ids) if sampling_params.prompt_logprobs is not None else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_ids(self) -> list[int]:
        """The first KV-cache group's block table (the only one without sliding windows)."""
        return self.block_tables[0] if self.block_tables else []

    @block_ids.setter
    def block_ids(self, blocks: list[int]) -> None:
        self.block_tables = [blocks]

    @property
    def in_flight(self) -> bool:
        return self.num_in_flight > 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def token_stop(self, max_model_len: int) -> tuple[str, int | None] | None:
        """The token-level stop rule the newest token meets, as (finish_reason, stop_reason),
        or None. The scheduler applies it (Scheduler.stop_request)."""
        params = self.sampling_params
        token = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return "length", None
        if self.num_tokens >= max_model_len:
            return "length", None
        return None
