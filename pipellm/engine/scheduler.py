"""Continuous batching with chunked prefill, prefix caching and preemption, for P micro-batches.

Each call to `schedule()` forms one micro-batch. A request's `num_computed_tokens` advances
when it is scheduled. A request whose next step samples (a decode, or the last chunk of its
prompt) waits until its in-flight micro-batch is applied, so it is in at most one sampling
micro-batch at a time. The chunks of a prompt before the last sample nothing, so with the
chunked pipeline (`enable_chunked_pipeline`, on by default) the next one goes into a new
micro-batch while earlier ones are still in flight: every stage runs micro-batches in
submission order, so chunk k has written its KV on a stage before chunk k+1 reaches that
stage. One long prompt then fills every stage (SGLang calls this chunked pipeline
parallelism). With it off, a request is in at most one in-flight micro-batch, as before.

Fair admission: a long prompt would otherwise take every micro-batch's whole token budget
until its prefill ends, and a short request arriving meanwhile would wait all that time. While
a short prompt waits (to be admitted, or with its own prompt tokens left), a prompt with more
tokens left than the fair share (the micro-batch's budget / (max_num_partial_prefills + 1)) is
a long one: it takes at most the fair share, and at most `max_num_partial_prefills` long
prompts get a chunk, so the rest of the budget goes to the short ones (a long waiting request
then lets short ones behind it go first). `long_prefill_token_threshold` (0: off; the engine's
default: DEFAULT_LONG_PREFILL_TOKENS in pipellm/config.py), as vLLM's
flag of that name, caps every prompt's chunk at all times, which bounds how long a request
arriving mid-step waits for that step; the fair share never exceeds it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pipellm.engine.block_manager import BlockManager
from pipellm.engine.chunk_cost import ChunkCostModel
from pipellm.engine.request import Request, RequestStatus
from pipellm.protocol import Logprobs, ModelOutput, ScheduledRequest, SchedulerOutput


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    num_stages: int = 1  # P: pipeline stages, so up to P micro-batches in flight
    pp_balance: bool = True
    pp_microbatch_tokens: int = 128  # balanced pipelines: most tokens per micro-batch
    # A prompt's next chunk may enter a micro-batch while its earlier chunks are in flight.
    enable_chunked_pipeline: bool = True
    chunk_cost: ChunkCostModel | None = None  # cost-balanced chunk sizes; None: fixed sizes
    # Fair admission (module docstring): a cap on any prompt's chunk (0: none), and how many
    # long prompts get a chunk while a short one waits.
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1


@dataclass
class TokenUpdate:
    """A token the scheduler appended; `finished` is set when a token-level stop rule hit."""

    request: Request
    token_id: int
    logprobs: Logprobs | None
    finished: bool
    error: str | None = None  # this request failed (token_id is then meaningless)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: FCFS, the newest is preempted first
        self.requests: dict[str, Request] = {}
        self._freed_ids: list[str] = []
        self._next_micro_batch_id = 0
        self.num_preemptions = 0
        self.num_in_flight_work = 0.0  # `_work` of chunks whose micro-batch has not returned
        self.num_in_flight_batches = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def stop_request(
        self, request_id: str, reason: str, stop_reason: int | str | None = None
    ) -> None:
        """Ends a request now, or when its in-flight micro-batch comes back: the one writer of
        finish_reason ("stop" | "length" | "abort" | "error") and stop_reason. The first
        reason stands."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        request.finish_reason, request.stop_reason = reason, stop_reason
        if request.in_flight:
            request.status = RequestStatus.FINISHED  # blocks freed when its last chunk returns
            return
        self._release(request)

    def _release(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.block_ids or request.num_tokens_sent:
            self._freed_ids.append(request.request_id)
        self.block_manager.free(request)
        self.requests.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_prompt_work(self) -> bool:
        """Whether the next micro-batch could carry prompt tokens: a running request's next
        prompt chunk, or a waiting request with room to admit it."""
        if any(r.num_tokens - r.num_computed_tokens > 1 for r in self._ready_running()):
            return True
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    # ---- forming a micro-batch -----------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        """Frees a running request's blocks; it is recomputed from scratch when resumed.

        Never while a chunk of it is in flight: a stage could still write into its blocks.
        """
        assert not request.in_flight, "preempting a request with a chunk in flight"
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_tokens_sent = 0
        request.num_blocks_sent = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._freed_ids.append(request.request_id)
        self.waiting.appendleft(request)  # resumed requests go first

    def _allocate_or_preempt(self, request: Request, num_tokens: int) -> bool:
        """Finds blocks for a running request, preempting the newest idle ones if needed."""
        while not self.block_manager.allocate_slots(request, num_tokens):
            victims = [r for r in self.running if not r.in_flight and r is not request]
            if not victims:
                return False  # wait for in-flight micro-batches to return their requests
            self._preempt(victims[-1])
        return True

    def _schedulable(self, request: Request) -> bool:
        """Whether a running request can join the micro-batch being formed.

        With nothing in flight, always: it has at least one token to compute (its prompt's
        rest, or the token sampled last). With chunks in flight, only under the chunked
        pipeline and only while prompt tokens remain: then none of its in-flight chunks
        samples (only the chunk that reaches the last token does), and the one that will
        goes in after them. A decode's next token does not exist until the last one returns.
        """
        if request.status != RequestStatus.RUNNING:
            return False
        if not request.in_flight:
            return True
        return (
            self.config.enable_chunked_pipeline and request.num_computed_tokens < request.num_tokens
        )

    def _ready_running(self) -> list[Request]:
        """Running requests that can join the micro-batch being formed."""
        return [r for r in self.running if self._schedulable(r)]

    def _admission_limit(self) -> int:
        """New or resumed requests per micro-batch: at most max(1, max_num_seqs // P), so a
        burst of arrivals is spread over the P micro-batches in flight instead of filling one
        while the other stages idle (vLLM issue #27462)."""
        cfg = self.config
        if cfg.pp_balance and cfg.num_stages > 1:
            return max(1, cfg.max_num_seqs // cfg.num_stages)
        return cfg.max_num_seqs

    def _work(self, prefix: int, num_tokens: int) -> float:
        """What a chunk of `num_tokens` after `prefix` computed tokens costs, in tokens at an
        empty prefix: its token count, or with `--pp-chunk-sizing cost` the chunk-cost model's
        estimate (decodes count as one token either way)."""
        model = self.config.chunk_cost
        if model is None or num_tokens <= 1:
            return num_tokens
        return model.cost(prefix, num_tokens)

    def _token_budget(self) -> float:
        """Work (tokens, or cost with a chunk-cost model) for the micro-batch being formed.

        Balanced pipelines give each micro-batch an equal share of the outstanding work (work
        in flight plus work ready to schedule), so stage times match and no stage waits on a
        heavy micro-batch while a light one has already passed. The share is taken over no more
        micro-batches than there are requests able to fill them, and a request's own remainder
        is not cut to fit it: it could not run in two micro-batches at once, so cutting it buys
        no overlap, only extra round trips. When the pipeline can be full, the share is capped
        at `pp_microbatch_tokens`: the pipeline fills and drains one micro-batch at a time, so
        a stage idles for about one micro-batch at each end of a burst of prompts, and small
        micro-batches keep that short.

        Under the chunked pipeline a prompt can be in several micro-batches at once, so the
        share is taken over all P as soon as any ready request has prompt tokens left, and a
        lone prompt is cut into chunks that fill every stage.
        """
        cfg = self.config
        if not (cfg.pp_balance and cfg.num_stages > 1):
            return cfg.max_num_batched_tokens
        ready = self._ready_running()
        ready += list(self.waiting)[: max(0, cfg.max_num_seqs - len(self.running))]
        if not ready:
            return cfg.max_num_batched_tokens
        remaining = [r.num_tokens - r.num_computed_tokens for r in ready]
        work = [self._work(r.num_computed_tokens, n) for r, n in zip(ready, remaining, strict=True)]
        total = self.num_in_flight_work + sum(work)
        if cfg.enable_chunked_pipeline and cfg.enable_chunked_prefill and max(remaining) > 1:
            ways = cfg.num_stages
            share = total / ways
        else:
            ways = min(cfg.num_stages, self.num_in_flight_batches + len(ready))
            share = max(total / ways, max(work))
        if ways == cfg.num_stages:
            share = min(share, self._work(0, cfg.pp_microbatch_tokens))
        if cfg.chunk_cost is None:
            share = math.ceil(share)
        return max(1, min(cfg.max_num_batched_tokens, share))

    def _take(self, prefix: int, num_new: int, budget: float, batch_empty: bool) -> int:
        """How many of a request's remaining tokens (after `prefix` computed ones) go in this
        micro-batch (0: none).

        With a chunk-cost model (`--pp-chunk-sizing cost`) a prompt chunk takes as many tokens
        as fit the budget's cost at its prefix, so chunks deep into a long prompt are smaller
        and every chunk costs about the same.
        """
        if self._work(prefix, num_new) <= budget * (1 + 1e-9):
            return num_new
        if self.config.enable_chunked_prefill:
            model = self.config.chunk_cost
            if model is None:
                return int(budget)
            return max(1, model.tokens_for(prefix, budget))
        # Whole prompts only: the first may exceed the balanced share, never the hard cap.
        if batch_empty and num_new <= self.config.max_num_batched_tokens:
            return num_new
        return 0

    def _fair_share(self, budget: float) -> int:
        """What a long prompt may take of a micro-batch while a short one waits."""
        cfg = self.config
        share = max(1, int(budget) // (cfg.max_num_partial_prefills + 1))
        return min(share, cfg.long_prefill_token_threshold or share)

    def _short_prompt_waits(self, threshold: int) -> bool:
        """Whether a prompt of at most `threshold` tokens left waits for budget: a waiting
        request, or a running one still in its prompt."""
        waiting = any(r.num_tokens <= threshold for r in self.waiting)
        return waiting or any(
            1 < r.num_tokens - r.num_computed_tokens <= threshold for r in self._ready_running()
        )

    def schedule(self) -> SchedulerOutput | None:
        """Forms the next micro-batch, or returns None when nothing can run now."""
        cfg = self.config
        budget = self._token_budget()
        chunks: list[tuple[Request, int, bool]] = []  # (request, tokens, is_new)
        # Fair admission: while a short prompt waits, long prompts get a capped share.
        fair_share = self._fair_share(budget)
        bound_long = cfg.enable_chunked_prefill and self._short_prompt_waits(fair_share)
        cap = fair_share if bound_long else cfg.long_prefill_token_threshold
        long_slots = cfg.max_num_partial_prefills if bound_long else len(self.requests)

        def is_long(request: Request) -> bool:
            return 0 < cap < request.num_tokens - request.num_computed_tokens

        # Decodes first (one token each, latency-bound), then unfinished prompt chunks.
        ready = self._ready_running()
        ready.sort(key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in ready:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted for an earlier request
                continue
            prefix = request.num_computed_tokens
            share = budget
            if is_long(request):
                if long_slots == 0:
                    continue
                long_slots -= 1
                share = min(budget, cap)
            num_new = self._take(prefix, request.num_tokens - prefix, share, not chunks)
            if num_new == 0:
                continue
            if not self._allocate_or_preempt(request, num_new):
                break  # FCFS: a newer request must not take the blocks this one waits for
            chunks.append((request, num_new, request.num_tokens_sent == 0))
            request.num_in_flight += 1  # from now on no victim of preemption
            budget -= self._work(prefix, num_new)

        num_admitted = 0
        while self.waiting and budget > 0:
            if len(self.running) >= cfg.max_num_seqs or num_admitted >= self._admission_limit():
                break
            request = next(
                (
                    r
                    for r in self.waiting
                    if not self._waits_for_fork(r) and (long_slots > 0 or not is_long(r))
                ),
                None,
            )
            if request is None:
                break
            cached = self._fork_blocks(request)
            if cached is None:
                cached = self.block_manager.find_cached_prefix(request)
            num_cached_tokens = len(cached[0]) * self.block_manager.block_size
            share = budget
            if is_long(request):
                share = min(budget, cap)
            num_new = self._take(
                num_cached_tokens, request.num_tokens - num_cached_tokens, share, not chunks
            )
            if num_new == 0:
                break
            if is_long(request):
                long_slots -= 1
            bm = self.block_manager
            if not bm.can_admit(cached, num_new):
                break
            self.waiting.remove(request)
            bm.take_cached_prefix(request, cached)
            # NOTE: not inside an assert, which `python -O` would skip with its allocation.
            allocated = bm.allocate_slots(request, num_new)
            assert allocated, "can_admit said the blocks were free"
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append((request, num_new, True))
            request.num_in_flight += 1
            num_admitted += 1
            budget -= self._work(num_cached_tokens, num_new)

        if not chunks:
            return None
        return self._make_output(chunks)

    def _num_fork_blocks(self, request: Request) -> int:
        """Full prompt blocks a parallel sample can share with the first sample (at least one
        prompt token is left to compute, for the logits); 0 when it cannot fork."""
        parent = request.fork_from
        if parent is None or request.sampling_params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt row computed
        if parent.status != RequestStatus.RUNNING or request.num_output_tokens:
            return 0  # the first sample finished or was preempted; resumed samples recompute
        return (request.num_prompt_tokens - 1) // self.block_manager.block_size

    def _waits_for_fork(self, request: Request) -> bool:
        """A parallel sample waits until the first sample's prompt blocks were scheduled in an
        earlier micro-batch: stages run micro-batches in order, so it then reads them written.
        """
        num_blocks = self._num_fork_blocks(request)
        return num_blocks > 0 and (
            request.fork_from.num_computed_tokens < num_blocks * self.block_manager.block_size
        )

    def _fork_blocks(self, request: Request) -> list[list[int]] | None:
        """Per KV-cache group, the first sample's prompt blocks this sample shares (ref
        counts), or None (also where a window group gave back blocks the sample needs)."""
        num_blocks = self._num_fork_blocks(request)
        if not num_blocks:
            return None
        return self.block_manager.shared_prefix(request.fork_from, num_blocks)

    def _make_output(self, chunks: list[tuple[Request, int, bool]]) -> SchedulerOutput:
        scheduled = []
        for request, num_new, is_new in chunks:
            known_blocks = 0 if is_new else request.num_blocks_sent
            item = ScheduledRequest(
                request_id=request.request_id,
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_new,
                new_token_ids=request.all_token_ids[0 if is_new else request.num_tokens_sent :],
                new_block_ids=request.block_ids[known_blocks:],
                new_group_block_ids=[table[known_blocks:] for table in request.block_tables[1:]],
                sampling_params=request.sampling_params if is_new else None,
                num_output_tokens=request.num_output_tokens,
            )
            request.num_tokens_sent = request.num_tokens
            request.num_blocks_sent = len(request.block_ids)
            request.num_computed_tokens += num_new
            item.sample = request.num_computed_tokens == request.num_tokens
            scheduled.append(item)
        output = SchedulerOutput(self._next_micro_batch_id, scheduled, self._freed_ids)
        self.num_in_flight_work += self._output_work(output)
        self.num_in_flight_batches += 1
        self._freed_ids = []
        self._next_micro_batch_id += 1
        return output

    def _output_work(self, output: SchedulerOutput) -> float:
        return sum(
            self._work(r.num_computed_tokens, r.num_scheduled_tokens) for r in output.requests
        )

    # ---- applying a micro-batch's result --------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelOutput
    ) -> list[TokenUpdate]:
        """Appends sampled tokens in submission order and applies token-level stop rules.

        A chunk's full blocks become findable by the prefix cache here, once the chunk has
        passed every stage, so no request can be given a block whose KV is still being written.
        """
        assert model_output.micro_batch_id == scheduler_output.micro_batch_id, (
            "outputs applied out of order"
        )
        self.num_in_flight_work -= self._output_work(scheduler_output)
        self.num_in_flight_batches -= 1
        updates = []
        sampled = iter(enumerate(model_output.sampled_token_ids))
        logprobs = iter(model_output.logprobs or [])
        prompt_logprobs = model_output.prompt_logprobs or {}
        for item in scheduler_output.requests:
            request = self.requests.get(item.request_id)
            row, token_id = next(sampled) if item.sample else (None, None)
            token_logprobs = next(logprobs, None) if item.sample else None
            if request is None:
                continue
            if item.request_id in prompt_logprobs:
                # Assigned by position: a prompt recomputed after preemption rewrites the same.
                position, entries = prompt_logprobs[item.request_id]
                request.prompt_logprobs[position : position + len(entries)] = entries
            request.num_in_flight -= 1
            if request.is_finished:  # aborted while in flight: released with its last chunk
                if not request.in_flight:
                    self._release(request)
                continue
            computed = item.num_computed_tokens + item.num_scheduled_tokens
            self.block_manager.cache_full_blocks(request, computed)
            if token_id is None:
                continue
            if row in model_output.failed:
                updates.append(TokenUpdate(request, token_id, None, True, model_output.failed[row]))
                self.stop_request(request.request_id, "error")
                continue
            request.append_output_token(token_id)
            stop = request.token_stop(self.config.max_model_len)
            updates.append(TokenUpdate(request, token_id, token_logprobs, stop is not None))
            if stop is not None:
                self.stop_request(request.request_id, *stop)
        return updates
