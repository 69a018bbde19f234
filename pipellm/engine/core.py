"""The engine loop: keep up to P micro-batches in flight, apply outputs in submission order.

This is the fix of vLLM issue #27462 in one place. While the batch queue has room and the
scheduler can form a micro-batch, submit it without waiting; only when the queue is full, or
nothing more can be scheduled, block on the *oldest* in-flight micro-batch and apply its
output. The queue holds P micro-batches plus `pp_async_batch_depth` spare ones (SGLang's
--pp-async-batch-depth) that carry prompt tokens: the scheduler only forms micro-batches that
need no in-flight output, so a spare one waits at the first stage, ready the moment that
stage is free.

`pp_blocking_loop` keeps one micro-batch in flight instead: the engine waits for each result
before scheduling the next, as vLLM's loop did before its PR #28768 (the seed report's second
half), so that what the non-blocking loop is worth can be measured apart from balancing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from pipellm.config import EngineConfig
from pipellm.engine.block_manager import BlockManager
from pipellm.engine.chunk_cost import CPU_ATTENTION_SLOWDOWN, ChunkCostModel
from pipellm.engine.microbatch_size import microbatch_tokens
from pipellm.engine.output_processor import TextState
from pipellm.engine.pipeline_stats import PipelineStats
from pipellm.engine.prompt_check import check_prompt
from pipellm.engine.request import Request
from pipellm.engine.scheduler import Scheduler, SchedulerConfig
from pipellm.executor.base import Executor, WorkerDiedError
from pipellm.executor.factory import make_executor
from pipellm.protocol import EngineOutput, EngineStats, ModelOutput, SchedulerOutput
from pipellm.sampling_params import SamplingParams
from pipellm.text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0
STATS_WINDOW_S = 60.0  # stats().pipeline (and /metrics' busy gauge) cover this recent window


def chunk_cost_model(config: EngineConfig) -> ChunkCostModel | None:
    """`--pp-chunk-sizing cost`: the model fitted for this hardware, or the sim backend's."""
    if config.pp_chunk_sizing != "cost":
        return None
    slowdown = CPU_ATTENTION_SLOWDOWN
    if config.distributed_executor_backend == "sim":
        from pipellm.executor.sim import profile_for

        hardware = profile_for(config).hardware  # None for fitted-coefficient profiles
        slowdown = 1.0
        if hardware is not None and hardware.attention_flops_per_s:
            slowdown = hardware.flops_per_s / hardware.attention_flops_per_s
    return ChunkCostModel.for_model(config.model_config, slowdown)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock  # pipellm simulate passes a virtual clock's
        self.tokenizer: Tokenizer = load_tokenizer(config.tokenizer_source)
        # generation_config.json may name more end tokens than the tokenizer does.
        self.eos_token_ids = tuple(
            sorted(set(self.tokenizer.eos_token_ids) | set(config.model_config.eos_token_ids))
        )
        groups = config.kv_cache_groups
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching, groups
        )
        logger.info(
            "KV cache: %s blocks of %d tokens (%.1f MiB)",
            " + ".join(
                f"{g.num_blocks}"
                + (f" (window {g.window}, {g.num_layers} layers)" if g.window else "")
                for g in groups
            ),
            config.block_size,
            config.num_kv_blocks * config.kv_bytes_per_block / 2**20,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_num_partial_prefills=config.max_num_partial_prefills,
                num_stages=config.pipeline_parallel_size,
                pp_balance=config.pp_balance,
                pp_microbatch_tokens=microbatch_tokens(config),
                enable_chunked_pipeline=config.enable_chunked_pipeline,
                chunk_cost=chunk_cost_model(config),
            ),
            self.block_manager,
        )
        self.executor = executor or make_executor(config)
        self.num_stages = config.pipeline_parallel_size  # P
        # P micro-batches in flight, one a stage, plus pp_async_batch_depth spare ones queued
        # at the first stage, so a late stage or a slow round trip leaves no stage idle while
        # prompts are being computed. With pp_blocking_loop, one: stages take turns.
        self.max_in_flight = config.max_micro_batches_in_flight
        self.in_flight: deque[tuple[SchedulerOutput, Future[ModelOutput]]] = deque()
        # Why a micro-batch failed, once one has: its requests never got their results, so
        # the scheduler cannot go on, and every later step raises this instead of idling.
        self.failure: str | None = None
        self.texts: dict[str, TextState] = {}
        self.samples: dict[str, list[str]] = {}  # request id -> its unfinished samples' ids
        self.pipeline_stats = PipelineStats(self.num_stages, clock=clock)
        self._last_log = clock()
        self.num_prompt_tokens = 0  # counters for metrics: prompt tokens admitted
        self.num_generation_tokens = 0

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        vocab = self.config.model_config.vocab_size
        check_prompt(prompt_token_ids, vocab, self.config.max_model_len)
        params = params.resolve(
            self.eos_token_ids,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            vocab,
        )
        if request_id in self.samples:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            requests = [Request(request_id, prompt_token_ids, params, self.eos_token_ids)]
        else:
            # n parallel samples, named as vLLM names them; all but the first fork its prompt.
            first = None
            requests = []
            for index in range(params.n):
                request = Request(
                    f"{index}_{request_id}",
                    prompt_token_ids,
                    params.for_sample(index),
                    self.eos_token_ids,
                    parent_id=request_id,
                    index=index,
                    fork_from=first,
                )
                first = first or request
                requests.append(request)
        # Text states first: making one may fail, and then nothing has been added yet.
        texts = {
            r.request_id: TextState(self.tokenizer, prompt_token_ids, r.sampling_params)
            for r in requests
        }
        for request in requests:
            self.scheduler.add_request(request)
        self.texts.update(texts)
        self.samples[request_id] = [r.request_id for r in requests]
        self.num_prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        """Aborts a request (all of its samples, for n > 1)."""
        for sample_id in self.samples.pop(request_id, []):
            self.scheduler.stop_request(sample_id, "abort")
            self.texts.pop(sample_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # ---- the loop --------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Submits micro-batches until the queue is full, then applies the oldest result.
        A failed micro-batch (a dead or failed stage) raises here, and so does every later
        call: the engine does not recover from it."""
        if self.failure is not None:
            raise WorkerDiedError(self.failure)
        while len(self.in_flight) < self.max_in_flight:
            if len(self.in_flight) >= self.num_stages and not self.scheduler.has_prompt_work():
                # A spare slot holds prompt work only. Decodes wait for their last token anyway,
                # and spread over more micro-batches they would only cost more passes over the
                # weights (measured: 2.7x the decode micro-batches, docs/pipeline.md).
                break
            scheduler_output = self.scheduler.schedule()
            if scheduler_output is None:
                break
            requests = self.scheduler.requests
            self.pipeline_stats.on_submit(
                scheduler_output.micro_batch_id,
                len(scheduler_output.requests),
                scheduler_output.num_tokens,
                len(self.in_flight) + 1,
                spread=max(
                    (requests[r.request_id].num_in_flight for r in scheduler_output.requests),
                    default=1,
                ),
            )
            self.in_flight.append((scheduler_output, self.executor.submit(scheduler_output)))
        if not self.in_flight:
            return []
        scheduler_output, future = self.in_flight[0]
        try:
            model_output = future.result()
        except Exception as error:
            self.failure = str(error) or type(error).__name__
            raise
        # Only now: an interrupt (Ctrl-C) while waiting leaves the micro-batch queued, so a
        # later step applies its result and its requests can go on.
        self.in_flight.popleft()
        self.pipeline_stats.on_done(scheduler_output.micro_batch_id, model_output.stage_times)
        self._maybe_log_stats()
        return self._apply(scheduler_output, model_output)

    def _maybe_log_stats(self) -> None:
        now = self.clock()
        if now - self._last_log < STATS_LOG_INTERVAL_S:
            return
        summary = self.pipeline_stats.summary(since=self._last_log)
        self._last_log = now
        if summary["num_micro_batches"]:
            logger.info(
                "running %d, waiting %d, KV cache %.0f%% | stage busy %s | queue depth %.1f | "
                "micro-batch %.1f requests, %.0f tokens",
                len(self.scheduler.running),
                len(self.scheduler.waiting),
                100 * self.block_manager.usage,
                " ".join(f"{f:.0%}" for f in summary["stage_busy_fraction"]),
                summary["mean_queue_depth"],
                summary["mean_requests_per_micro_batch"],
                summary["mean_tokens_per_micro_batch"],
            )

    def stats(self) -> EngineStats:
        """A snapshot for logs and /metrics; `pipeline` covers the last STATS_WINDOW_S."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.block_manager.num_prefix_queries,
            prefix_cache_hits=self.block_manager.num_prefix_hits,
            num_in_flight=len(self.in_flight),
            prompt_tokens_total=self.num_prompt_tokens,
            generation_tokens_total=self.num_generation_tokens,
            pipeline=self.pipeline_stats.summary(since=self.clock() - STATS_WINDOW_S),
            stage_busy_seconds_total=list(self.pipeline_stats.stage_busy_total),
            pipeline_active_seconds_total=self.pipeline_stats.active_total,
        )

    def _apply(
        self, scheduler_output: SchedulerOutput, model_output: ModelOutput
    ) -> list[EngineOutput]:
        outputs = []
        for update in self.scheduler.update_from_output(scheduler_output, model_output):
            request = update.request
            if update.error is not None:
                outputs.append(self._failed(request, update.error))
                continue
            self.num_generation_tokens += 1
            text = self.texts[request.request_id]
            try:
                delta, stop_string = text.push(update.token_id, update.finished)
            except Exception as error:  # fail this request only; the log keeps the traceback
                logger.exception("detokenizing request %s failed", request.request_id)
                self.scheduler.stop_request(request.request_id, "error")
                outputs.append(
                    self._failed(request, f"detokenizing failed: {type(error).__name__}")
                )
                continue
            if stop_string is not None and not update.finished:
                self.scheduler.stop_request(request.request_id, "stop", stop_string)
            finished = request.is_finished
            request_finished = False
            if finished:
                samples = self.samples[request.parent_id]
                samples.remove(request.request_id)
                request_finished = not samples
                if request_finished:
                    del self.samples[request.parent_id]
            outputs.append(
                EngineOutput(
                    request_id=request.parent_id,
                    index=request.index,
                    request_finished=request_finished,
                    new_token_ids=[update.token_id],
                    new_text=delta,
                    finished=finished,
                    finish_reason=request.finish_reason if finished else None,
                    stop_reason=request.stop_reason if finished else None,
                    new_logprobs=[update.logprobs] if update.logprobs else None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    prompt_logprobs=(
                        request.prompt_logprobs if request.num_output_tokens == 1 else None
                    ),
                )
            )
            if finished:
                del self.texts[request.request_id]
        return outputs

    def _failed(self, request: Request, error: str) -> EngineOutput:
        """The last output of a request that failed inside the engine; for n > 1 the failure
        ends the whole request, so its other samples are aborted."""
        self.texts.pop(request.request_id, None)
        for sample_id in self.samples.pop(request.parent_id, []):
            if sample_id != request.request_id:
                self.scheduler.stop_request(sample_id, "abort")
                self.texts.pop(sample_id, None)
        return EngineOutput(
            request_id=request.parent_id,
            index=request.index,
            request_finished=True,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=request.num_prompt_tokens,
            error=error,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.config.trace_file:
            self.pipeline_stats.write_trace(self.config.trace_file)
            logger.info("wrote pipeline trace to %s", self.config.trace_file)
