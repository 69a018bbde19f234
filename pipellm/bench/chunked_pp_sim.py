"""One long prompt through eight modelled stages: chunked pipeline parallelism against the ideal.

The sim backend (docs/simulation.md) at P = 8 with SmolLM2-135M's shapes, stretched to a
context of 34k tokens (the sim computes nothing, so the model only needs a config), on the
virtual clock of `pipellm simulate` (the real engine and scheduler, modelled stages, no
sleeping): one prompt of --prompt-len tokens -> 1 token, alone in the engine. Time to first
token, in modelled seconds, for:
  off          --no-enable-chunked-pipeline: one chunk in flight at a time
  fixed N      the chunked pipeline, N-token chunks (--pp-microbatch-tokens N)
  cost N       the chunked pipeline, cost-balanced chunks (--pp-chunk-sizing cost): each costs
               what N tokens cost at an empty prefix, so later chunks shrink
against the ideal: the whole prompt's work on all stages (as one chunk each, by the sim's own
cost model) divided by 8, plus the fill of one chunk (a first N-token chunk through 7 stages).

  .venv/bin/python -m pipellm.bench.chunked_pp_sim [--prompt-len 32768 --sizes 128,512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from pipellm.config import EngineConfig  # noqa: E402
from pipellm.engine.core import EngineCore  # noqa: E402
from pipellm.executor.sim import VirtualSimExecutor  # noqa: E402
from pipellm.protocol import ScheduledRequest, SchedulerOutput  # noqa: E402
from pipellm.sampling_params import SamplingParams  # noqa: E402
from pipellm.sim.clock import VirtualClock  # noqa: E402
from tests.checkpoints import make_tiny_checkpoint  # noqa: E402

STAGES = 8


def make_model(directory: Path, context: int) -> str:
    """A tiny checkpoint (tokenizer and all) whose config takes SmolLM2-135M's shapes."""
    make_tiny_checkpoint(directory, num_layers=2)
    smol = EngineConfig(distributed_executor_backend="sim").model_config
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(
        hidden_size=smol.hidden_size,
        intermediate_size=smol.intermediate_size,
        num_hidden_layers=smol.num_hidden_layers,
        num_attention_heads=smol.num_attention_heads,
        num_key_value_heads=smol.num_key_value_heads,
        head_dim=smol.head_dim,
        max_position_embeddings=context,
    )
    config_path.write_text(json.dumps(config))
    return str(directory)


def engine_config(model: str, args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(
        model=model,
        pipeline_parallel_size=STAGES,
        distributed_executor_backend="sim",
        max_model_len=args.prompt_len + 16,
        enable_prefix_caching=False,
        kv_cache_memory=64 << 30,  # bookkeeping only: the sim allocates no cache
        **overrides,
    )


def ttft(config: EngineConfig, prompt_len: int, trace: str | None = None) -> tuple[float, dict]:
    config.trace_file = trace
    clock = VirtualClock()
    core = EngineCore(config, VirtualSimExecutor(config, clock), clock=clock.time)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    try:
        started = clock.time()
        core.add_request("long", [7] * prompt_len, params)
        while core.has_unfinished_requests():
            core.step()
        seconds = clock.time() - started
    finally:
        core.shutdown()
    return seconds, core.pipeline_stats.summary()


def ideal(config: EngineConfig, prompt_len: int, chunk: int) -> float:
    executor = VirtualSimExecutor(config, VirtualClock())
    whole = SchedulerOutput(0, [ScheduledRequest("p", 0, prompt_len, [], [], sample=True)])
    first = SchedulerOutput(0, [ScheduledRequest("p", 0, chunk, [], [])])
    work = sum(executor.step_times(whole)[0])
    return work / STAGES + sum(executor.step_times(first)[0][:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=32768)
    parser.add_argument("--sizes", default="128,512", help="chunk budgets (tokens) to compare")
    parser.add_argument("--repeats", type=int, default=1, help="the virtual clock is exact")
    parser.add_argument("--skip-off", action="store_true", help="skip the 'off' run")
    parser.add_argument("--trace-dir", default="results")
    args = parser.parse_args()
    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "smol-shaped", args.prompt_len + 16)
        setups = [] if args.skip_off else [("off", dict(enable_chunked_pipeline=False), sizes[0])]
        for n in sizes:
            setups.append((f"fixed {n}", dict(pp_microbatch_tokens=n), n))
            setups.append((f"cost {n}", dict(pp_microbatch_tokens=n, pp_chunk_sizing="cost"), n))
        results: dict[str, list[float]] = {label: [] for label, _, _ in setups}
        stats: dict[str, dict] = {}
        for repeat in range(args.repeats):
            for label, overrides, _ in setups:
                trace = None
                if repeat == 0:
                    trace = f"{args.trace_dir}/chunked_pp_sim_{label.replace(' ', '_')}.trace.json"
                seconds, summary = ttft(
                    engine_config(model, args, **overrides), args.prompt_len, trace
                )
                results[label].append(seconds)
                stats.setdefault(label, summary)
                print(
                    f"[{repeat}] {label:10s} TTFT {seconds:7.2f} s (modelled)  micro-batches "
                    f"{summary['num_micro_batches']}  queue depth {summary['mean_queue_depth']:.2f}"
                    f"  busy {statistics.mean(summary['stage_busy_fraction']):.0%}",
                    flush=True,
                )
        config = engine_config(model, args)
    print(f"\n{'setup':10s} {'TTFT s':>8s} {'ideal s':>8s} {'of ideal':>9s} {'chunks':>7s}")
    for label, _, chunk in setups:
        best = statistics.median(results[label])
        target = ideal(config, args.prompt_len, chunk)
        print(
            f"{label:10s} {best:8.2f} {target:8.2f} {target / best:9.1%} "
            f"{stats[label]['num_micro_batches']:7d}"
        )


if __name__ == "__main__":
    main()
