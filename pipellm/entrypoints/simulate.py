"""`pipellm simulate`'s arguments: `bench serve`'s workload flags and the engine's; the run
itself is pipellm/sim/simulate/."""

from __future__ import annotations

import argparse
from typing import Any

from pipellm.bench.serve import add_output_args, add_workload_args, check_args
from pipellm.sampling_params import SamplingParams


def served_params(prompt_ids: list[int], max_tokens: int, ignore_eos: bool) -> SamplingParams:
    """What the server makes of a streamed greedy completions request (bench serve's own)."""
    from pipellm.entrypoints.openai_protocol import CompletionRequest

    body = CompletionRequest(
        model="simulated",
        prompt=prompt_ids,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=ignore_eos,
        stream=True,
    )
    return body.sampling_params(max_tokens, None)


def run_simulate(args: argparse.Namespace) -> dict[str, Any]:
    from pipellm.entrypoints.engine_args import engine_config_from_args
    from pipellm.sim.simulate import simulate

    if args.distributed_executor_backend != "sim":
        raise ValueError(
            f"pipellm simulate models the stages: --distributed-executor-backend must be sim, "
            f"not {args.distributed_executor_backend}"
        )
    check_args(args)
    return simulate(args, engine_config_from_args(args), served_params)


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
        func=run_simulate,
    )
