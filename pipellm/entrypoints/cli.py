"""`pipellm` command line: generate, serve, simulate, profile, bench serve, trace, demo."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from pipellm.loader.registry import MODEL_ARGUMENT_HELP


class _Parser(argparse.ArgumentParser):
    """Flag errors in one line (the usage of ~30 engine flags would bury the message)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


CHAT_TEMPLATE_HELP = (
    "Jinja chat template file (or the template itself) for chats: replaces the model's own, "
    "or gives one to a model without (as a base model's GGUF)"
)


def _generate(args: argparse.Namespace) -> None:
    import time

    from pipellm.entrypoints.engine_args import engine_config_from_args
    from pipellm.llm import LLM
    from pipellm.sampling_params import SamplingParams
    from pipellm.text.chat_template import read_chat_template

    if args.chat_template and not args.chat:
        raise ValueError("--chat-template applies to chats: add --chat")
    config = engine_config_from_args(args)
    template = read_chat_template(args.chat_template) if args.chat_template else None
    llm = LLM.from_config(config)
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        started = time.perf_counter()
        if args.chat:
            messages = [{"role": "user", "content": p} for p in args.prompt]
            outputs = llm.chat(messages, params, chat_template=template)
        else:
            outputs = llm.generate(args.prompt, params)
        elapsed = time.perf_counter() - started
        for prompt, out in zip(args.prompt, outputs, strict=True):
            print(f"--- {prompt!r}\n{out.outputs[0].text}")
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"{generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)")
    finally:
        llm.shutdown()


def _serve(args: argparse.Namespace) -> None:
    from pipellm.engine.core_process import EngineStartupError
    from pipellm.entrypoints.openai_server import run_server

    try:
        exit_code = run_server(args)
    except EngineStartupError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    if exit_code:
        print("error: the engine core died; see the log above", file=sys.stderr)
        sys.exit(exit_code)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from pipellm.entrypoints.engine_args import add_engine_args
    from pipellm.entrypoints.server_limits import add_limit_args
    from pipellm.entrypoints.tool_parsers import add_tool_call_args

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve MODEL over the OpenAI API: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /version.",
    )
    serve.add_argument("model", nargs="?", help=MODEL_ARGUMENT_HELP)
    server = serve.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)"
    )
    server.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    server.add_argument(
        "--served-model-name", help="model id in the API (default: the MODEL argument)"
    )
    server.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP)
    server.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PIPELLM_API_KEY)",
    )
    add_limit_args(serve)
    add_tool_call_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=_serve)


def require_plot_extra(what: str) -> None:
    """PNGs need matplotlib, an optional dependency: say so before any work starts."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            f"{what} draws PNGs with matplotlib, which is not installed: "
            "pip install 'pipellm[plot]'"
        )


def _add_profile_args(parser: argparse.ArgumentParser) -> None:
    from pipellm.sim.profiler import profile

    parser.add_argument(
        "model", nargs="?", help="local HF folder, .gguf, or built-in preset (default: SmolLM2)"
    )
    parser.add_argument("--output", required=True, help="where to write the profile JSON")
    parser.add_argument(
        "--pipeline-parallel-sizes",
        default="1,2",
        help="time every stage of each of these P (comma-separated; default %(default)s)",
    )
    parser.add_argument(
        "--num-threads", type=int, default=1, help="torch threads per stage (default 1)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="context length (default: the model's); grid points beyond it are skipped",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed runs per micro-batch (after a warm-up)"
    )
    parser.add_argument(
        "--timing",
        choices=("stream", "alone"),
        default="stream",
        help="stream: each grid point's copies go through the engine's own executor with its "
        "in-flight depth, every stage busy, as in serving; alone: each stage timed alone and "
        "with all P at once, which also measures concurrent_slowdown (default %(default)s)",
    )
    parser.set_defaults(func=profile)


def _demo(args: argparse.Namespace) -> None:
    from pipellm.entrypoints.demo import run_demo

    require_plot_extra("pipellm demo")
    run_demo()


def _bench_serve(args: argparse.Namespace) -> dict:
    from pipellm.bench.serve import main as bench_main

    if args.plot:
        require_plot_extra("--plot")
    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    from pipellm.entrypoints.engine_args import add_engine_args

    parser = _Parser(prog="pipellm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline for a few prompts")
    gen.add_argument("model", nargs="?", help=MODEL_ARGUMENT_HELP)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    _add_serve_parser(sub)

    simulate = sub.add_parser(
        "simulate",
        help="bench serve's workload against the real engine over modelled stages, in virtual time",
        description="Runs the engine loop and scheduler over modelled pipeline stages "
        "(--sim-profile) on a virtual clock and prints `bench serve`'s table for the workload "
        "the dataset and load flags describe (docs/simulation.md).",
    )
    from pipellm.entrypoints.simulate import add_cli_args as add_simulate_args

    add_simulate_args(simulate)

    profile = sub.add_parser(
        "profile",
        help="time this machine's stage steps and write a sim profile",
        description="Times real pipeline-stage steps of MODEL on this machine over a grid of "
        "micro-batch shapes, fits the linear cost model of docs/simulation.md, prints the fit "
        "error and writes a profile for --sim-profile.",
    )
    _add_profile_args(profile)

    demo = sub.add_parser("demo", help="the main job on the built-in model")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    from pipellm.bench.serve import add_cli_args

    add_cli_args(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)

    _add_trace_parser(sub)
    return parser


def _add_trace_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser(
        "trace",
        help="read a pipeline trace written with --trace-file",
        description="Tools for the Chrome/Perfetto trace that `pipellm serve --trace-file` "
        "writes: one lane per stage, one slice per micro-batch.",
    )
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    timeline = trace_sub.add_parser(
        "timeline", help="draw the stages' micro-batches as a PNG (needs pipellm[plot])"
    )
    timeline.add_argument("trace", help="the trace JSON")
    timeline.add_argument("png", help="where to write the PNG")
    timeline.add_argument("--title", default="", help="default: the trace's file name")
    timeline.add_argument("--seconds", type=float, help="show only the first S seconds")
    timeline.set_defaults(func=_trace_timeline)
    bubbles = trace_sub.add_parser(
        "bubbles", help="why each stage sat idle: overhead or waiting, per stage"
    )
    bubbles.add_argument("trace", help="the trace JSON")
    bubbles.set_defaults(func=_trace_bubbles)


def _trace_timeline(args: argparse.Namespace) -> None:
    from pipellm.engine.trace_timeline import render_timeline

    require_plot_extra("pipellm trace timeline")
    render_timeline(args.trace, args.png, args.title, args.seconds)
    print(f"timeline written to {args.png}")


def _trace_bubbles(args: argparse.Namespace) -> None:
    from pipellm.engine.trace_bubbles import print_stage_gaps

    print_stage_gaps(args.trace)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as error:  # config and input errors: one clear line, no traceback
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
