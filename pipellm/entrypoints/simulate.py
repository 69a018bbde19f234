"""`pipellm simulate`: `bench serve`'s workload against the real engine loop, in virtual time.

Nothing of the engine is copied: `EngineCore` (scheduler, batch queue, output processing)
runs inside the very loop the server's engine process runs (`serve_messages`), with a
`VirtualSimExecutor` for the stages and a `VirtualClock` for time. The only stand-in is
`VirtualClient`, which plays the API server and `bench serve`'s client: it sends requests at
their arrival times, at most --max-concurrency at once, and stamps every streamed token with
the virtual time the engine produced it. The figures and table are `bench serve`'s own code.
"""

from __future__ import annotations

import argparse
import heapq
import math
import queue
import time
from collections import deque
from typing import Any

import numpy as np

from pipellm.bench.datasets import length_range
from pipellm.bench.metrics import RequestTiming
from pipellm.bench.serve import (
    add_output_args,
    add_workload_args,
    arrival_offsets,
    check_args,
    report,
    sample_requests,
)
from pipellm.protocol import AddRequest, FromCore, Outputs, Rejected, Shutdown, ToCore
from pipellm.sim.clock import VirtualClock
from pipellm.sim.cost import Serving

EngineRequest = tuple[str, list[int], Any, int]  # (id, prompt ids, SamplingParams, prompt_len)


class VirtualClient:
    """The engine loop's inbox and connection: requests in at their send times, tokens out.

    Sends follow `bench serve`: request i is due at start + offsets[i] and waits for one of
    max_concurrency slots (first come, first served); a slot frees when the client has the
    request's last token. The serving path's delays come from the profile's `serving`
    section: the client sends one request at a time (send_interval_s apart), a request
    reaches the engine request_latency_s after it is sent, and a token reaches the client
    output_latency_s after the engine emits it.
    """

    def __init__(
        self,
        clock: VirtualClock,
        requests: list[EngineRequest],
        offsets: list[float],
        max_concurrency: int,
        serving: Serving,
    ) -> None:
        self.clock = clock
        self.requests = requests
        self.serving = serving
        start = clock.now
        self._due = deque((start + offset, i) for i, offset in enumerate(offsets))
        self._queued: deque[int] = deque()  # due, waiting for a slot
        self._free_slots = max_concurrency
        self._slot_frees: list[float] = []  # heap: when finished requests' slots free
        self._in_transit: list[tuple[float, int]] = []  # heap: (reaches the engine, request)
        self._client_now = start  # the client has acted on everything before this
        self._last_send = -math.inf
        self._unfinished = len(requests)
        self._index = {request_id: i for i, (request_id, *_) in enumerate(requests)}
        self.outputs = [RequestTiming(prompt_len=r[3]) for r in requests]
        self._texts: list[list[str]] = [[] for _ in requests]

    @property
    def end_time(self) -> float:
        """When the client had the last token of the last request."""
        return max(out.end_time for out in self.outputs)

    # ---- the client, between engine events ---------------------------------------------------

    def _next_client_event(self) -> tuple[float, str]:
        events = [(math.inf, "none")]
        if self._due:
            events.append((self._due[0][0], "due"))
        if self._slot_frees:
            events.append((self._slot_frees[0], "free"))
        if self._queued and self._free_slots:
            send_at = max(self._client_now, self._last_send + self.serving.send_interval_s)
            events.append((send_at, "send"))
        return min(events)

    def _run_client_until(self, until: float) -> None:
        while True:
            when, kind = self._next_client_event()
            if when > until:
                break
            self._client_now = max(self._client_now, when)
            if kind == "due":
                self._queued.append(self._due.popleft()[1])
            elif kind == "free":
                heapq.heappop(self._slot_frees)
                self._free_slots += 1
            else:
                i = self._queued.popleft()
                self._free_slots -= 1
                self._last_send = when
                self.outputs[i].start_time = when
                heapq.heappush(self._in_transit, (when + self.serving.request_latency_s, i))
        self._client_now = max(self._client_now, until)

    def _arrived(self) -> ToCore | None:
        self._run_client_until(self.clock.now)
        if not (self._in_transit and self._in_transit[0][0] <= self.clock.now):
            return None
        request_id, prompt_ids, params, _ = self.requests[heapq.heappop(self._in_transit)[1]]
        return AddRequest(request_id, prompt_ids, params)

    # ---- the inbox ---------------------------------------------------------------------------

    def get_nowait(self) -> ToCore:
        message = self._arrived()
        if message is None:
            raise queue.Empty
        return message

    def get(self, timeout: float | None = None) -> ToCore:
        """The engine is idle: the next request, after waiting for it if need be; SHUTDOWN
        when every request is done."""
        while (message := self._arrived()) is None:
            if not self._unfinished:
                return Shutdown()
            when = self._next_client_event()[0]
            if self._in_transit:
                when = min(when, self._in_transit[0][0])
            if when == math.inf:
                raise RuntimeError("the engine is idle but requests are open; none can finish")
            self.clock.advance_to(when)
        return message

    # ---- the connection ----------------------------------------------------------------------

    def send(self, message: FromCore) -> None:
        seen = self.clock.now + self.serving.output_latency_s
        if isinstance(message, Rejected):
            i = self._index[message.request_id]
            self.outputs[i].error = message.reason
            self._finish(i, seen, success=False)
        elif isinstance(message, Outputs):
            for out in message.outputs:
                i = self._index[out.request_id]
                request = self.outputs[i]
                request.output_tokens += len(out.new_token_ids)
                if out.new_text:  # as bench serve's client: only chunks with text are timed
                    request.chunk_times.append(seen)
                    self._texts[i].append(out.new_text)
                if out.request_finished:
                    self._finish(i, seen, success=True)

    def _finish(self, i: int, seen: float, success: bool) -> None:
        out = self.outputs[i]
        out.end_time = seen
        out.success = success
        out.generated_text = "".join(self._texts[i])
        heapq.heappush(self._slot_frees, seen)
        self._unfinished -= 1


def workload(args: argparse.Namespace, tokenizer: Any, model: str) -> list[EngineRequest]:
    """The requests of `bench serve`'s workload as the server would hand them to the engine.

    The random dataset is drawn as token ids directly, by `bench serve`'s length rule (a
    shared random prefix, then lengths uniform in [floor(L(1-r)), ceil(L(1+r))]): only the
    number of tokens matters to modelled stages, and fitting random text to exact token
    counts would take longer than the simulation. ShareGPT prompts are tokenized as served.
    """
    from pipellm.entrypoints.openai_protocol import CompletionRequest

    count = args.num_prompts + args.num_warmups
    ignore_eos = args.ignore_eos or args.dataset_name == "random"
    if args.dataset_name == "random":
        rng = np.random.default_rng(args.seed)
        vocab = tokenizer.vocab_size
        input_low, input_high = length_range(args.random_input_len, args.random_range_ratio)
        output_low, output_high = length_range(args.random_output_len, args.random_range_ratio)
        prefix = rng.integers(0, vocab, args.random_prefix_len).tolist()
        prompts = []
        for _ in range(count):
            body_len = int(rng.integers(input_low, input_high + 1))
            num_output = int(rng.integers(output_low, output_high + 1))
            prompts.append((prefix + rng.integers(0, vocab, body_len).tolist(), num_output))
    else:
        samples = sample_requests(args, tokenizer, count)
        prompts = [(tokenizer.encode(s.prompt), s.output_len) for s in samples]
    requests = []
    for i, (prompt_ids, num_output) in enumerate(prompts):
        body = CompletionRequest(
            model=model,
            prompt=prompt_ids,
            max_tokens=num_output,
            temperature=0.0,
            ignore_eos=ignore_eos,
            stream=True,
        )
        params = body.sampling_params(num_output, None)
        requests.append((str(i), prompt_ids, params, len(prompt_ids)))
    return requests


def run_phase(
    core: Any,
    clock: VirtualClock,
    requests: list[EngineRequest],
    offsets: list[float],
    max_concurrency: int,
    serving: Serving,
) -> VirtualClient:
    """Runs the engine loop until every request of the phase has finished."""
    from pipellm.engine.core_process import serve_messages

    client = VirtualClient(clock, requests, offsets, max_concurrency, serving)
    serve_messages(core, client, client)  # type: ignore[arg-type]
    clock.advance_to(client.end_time)
    return client


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the workload; prints and returns `bench serve`'s result."""
    from pipellm.engine.core import EngineCore
    from pipellm.entrypoints.engine_args import engine_config_from_args
    from pipellm.executor.sim import VirtualSimExecutor

    if args.distributed_executor_backend != "sim":
        raise ValueError(
            f"pipellm simulate models the stages: --distributed-executor-backend must be sim, "
            f"not {args.distributed_executor_backend}"
        )
    check_args(args)
    config = engine_config_from_args(args)
    wall_start = time.perf_counter()
    clock = VirtualClock()
    executor = VirtualSimExecutor(config, clock)
    core = EngineCore(config, executor, clock=clock.time)
    try:
        requests = workload(args, core.tokenizer, config.model_name)
        timed, warmups = requests[: args.num_prompts], requests[args.num_prompts :]
        concurrency = args.max_concurrency or len(requests)
        serving = executor.profile.serving
        print(
            f"Simulating {args.num_prompts} requests on {config.pipeline_parallel_size} modelled "
            f"stages ({args.sim_profile or 'the reference CPU roofline'}): request rate "
            f"{args.request_rate}, burstiness {args.burstiness}, max concurrency "
            f"{args.max_concurrency or 'unlimited'}, {args.num_warmups} warmups"
        )
        if warmups:
            run_phase(core, clock, warmups, [0.0] * len(warmups), concurrency, serving)
        start = clock.now
        offsets = arrival_offsets(len(timed), args.request_rate, args.burstiness, args.seed)
        client = run_phase(core, clock, timed, offsets, concurrency, serving)
        duration = clock.now - start
        result = report(args, config.model_name, client.outputs, start, duration)
        # Not bench serve's: where the modelled time went (sim_fidelity compares it).
        result["pipeline"] = core.pipeline_stats.summary(since=start)
    finally:
        core.shutdown()
    wall = time.perf_counter() - wall_start
    speed = clock.now / wall if wall > 0 else math.inf
    print(
        f"Simulated {clock.now:.2f} s of virtual time in {wall:.2f} s of wall time "
        f"({speed:.0f}x real time)"
    )
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pipellm.entrypoints.engine_args import add_engine_args

    parser.add_argument(
        "model", nargs="?", help="local HF folder, .gguf, or built-in preset (default: SmolLM2)"
    )
    add_engine_args(parser)
    add_workload_args(parser, seed=False)
    add_output_args(parser)
    # Settings the result file records, as `bench serve` would against a completions server.
    parser.set_defaults(
        distributed_executor_backend="sim",
        backend="sim",
        endpoint="/v1/completions",
        func=simulate,
    )
