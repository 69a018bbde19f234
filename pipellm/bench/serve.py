"""`pipellm bench serve`: load generator for any OpenAI-compatible server.

Flags, defaults and the result table follow the familiar `vllm bench serve`; see
docs/bench_serve.md for the metric definitions.
"""

import argparse
import asyncio
import math
import os
import time
from collections import Counter
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from pipellm.bench.client import build_payload, is_chat_endpoint, send_request
from pipellm.bench.datasets import (
    SampleRequest,
    TokenizerLike,
    sample_random_requests,
    sample_sharegpt_requests,
)
from pipellm.bench.metrics import METRICS, RequestTiming, compute_metrics
from pipellm.bench.report import format_table, save_result

# The familiar tool's fixed per-request limit; long prompts on slow servers need hours.
DEFAULT_REQUEST_TIMEOUT_S = 6 * 60 * 60
MAX_ERRORS_SHOWN = 3


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of `pipellm bench serve`, named and defaulted like `vllm bench serve`."""
    _add_server_args(parser)
    add_workload_args(parser)
    add_output_args(parser)


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--backend",
        choices=["openai", "vllm", "openai-chat"],
        default="openai",
        help="API flavour: openai/vllm send text completions, openai-chat sends chat messages "
        "(needs a chat --endpoint). Also the default --label.",
    )
    server.add_argument(
        "--base-url",
        default=None,
        help="Server URL, e.g. http://host:8000; overrides --host/--port.",
    )
    server.add_argument("--host", default="127.0.0.1", help="Server host.")
    server.add_argument("--port", type=int, default=8000, help="Server port.")
    server.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="API path: /v1/completions or /v1/chat/completions.",
    )
    server.add_argument(
        "--model", default=None, help="Model name to request; default: the server's first model."
    )
    server.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer (name or path) for the prompts; default: --model.",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="Seconds one request may take before it counts as failed.",
    )


def add_workload_args(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """The dataset and load flags (`pipellm simulate` takes them too; its engine's --seed
    doubles as the workload's, so seed=False leaves that flag out)."""
    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        choices=["random", "sharegpt"],
        default="random",
        help="random: random-token prompts; sharegpt: first turns of --dataset-path.",
    )
    data.add_argument(
        "--dataset-path", default=None, help="Local ShareGPT-format JSON (nothing is downloaded)."
    )
    data.add_argument("--num-prompts", type=int, default=1000, help="Requests in the timed run.")
    data.add_argument(
        "--random-input-len", type=int, default=1024, help="Mean prompt tokens (random dataset)."
    )
    data.add_argument(
        "--random-output-len", type=int, default=128, help="Mean output tokens (random dataset)."
    )
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="r in [0, 1): lengths uniform in [floor(L(1-r)), ceil(L(1+r))].",
    )
    data.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="Tokens of a random prefix shared by all prompts, before the random part.",
    )
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="Output tokens per ShareGPT request; default: the length of the recorded reply.",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="Most requests in flight at once."
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second; inf (default) sends all at once.",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the inter-arrival times: 1 is Poisson, <1 burstier, >1 steadier.",
    )
    load.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="Requests sent before the timed run and left out of every figure.",
    )
    if seed:
        load.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrival times.")
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Ask the server to ignore EOS (always on for the random dataset).",
    )


def add_output_args(parser: argparse.ArgumentParser) -> None:
    output = parser.add_argument_group("output")
    output.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help=f"Comma-separated latency sections to print, from {','.join(METRICS)}.",
    )
    output.add_argument(
        "--metric-percentiles", default="99", help='Comma-separated percentiles, e.g. "50,90,99".'
    )
    output.add_argument("--save-result", action="store_true", help="Write the result as JSON.")
    output.add_argument(
        "--save-detailed",
        action="store_true",
        help="Also write per-request lists (lengths, TTFTs, ITLs, texts, errors); implies "
        "--save-result.",
    )
    output.add_argument(
        "--result-dir", default=None, help="Folder for the result file; default: current folder."
    )
    output.add_argument(
        "--result-filename",
        default=None,
        help="Result file name; default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json.",
    )
    output.add_argument(
        "--label", default=None, help="Label of the run in the result; default: --backend."
    )
    output.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="Draw TTFT and ITL distributions and output tokens/s over time into FILE.png.",
    )
    output.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Resolve model and tokenizer, then run the benchmark; returns the result."""
    base_url = _base_url(args)
    model = args.model or asyncio.run(fetch_first_model(base_url))
    return run(args, model, load_tokenizer(args.tokenizer or model))


def load_tokenizer(name: str) -> TokenizerLike:
    """The tokenizer pipellm itself would use for name."""
    # Imported here: only this step needs the model package (and the torch it brings).
    from pipellm.loader.source import resolve_model
    from pipellm.text.tokenizer import load_tokenizer as load_model_tokenizer

    try:
        return load_model_tokenizer(resolve_model(name, require_weights=False))
    except Exception as e:
        raise SystemExit(
            f"could not load the tokenizer of {name!r} ({e}); pass --tokenizer PATH "
            "(a local model folder or a built-in preset)"
        ) from e


async def fetch_first_model(base_url: str) -> str:
    """The first model id the server lists at /v1/models."""
    url = f"{base_url}/v1/models"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url, headers=_auth_headers()) as response:
                response.raise_for_status()
                return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, KeyError, IndexError) as e:
        raise SystemExit(
            f"could not list models at {url} ({e}); is the server up? Or pass --model"
        ) from e


def run(args: argparse.Namespace, model: str, tokenizer: TokenizerLike) -> dict[str, Any]:
    """Sample prompts, run warmups and the timed run, print the table; returns the result."""
    check_args(args)
    chat = is_chat_endpoint(args.endpoint)
    requests = sample_requests(args, tokenizer, args.num_prompts + args.num_warmups)
    ignore_eos = args.ignore_eos or args.dataset_name == "random"
    payloads = [build_payload(request, model, chat, ignore_eos) for request in requests]
    url = _base_url(args) + args.endpoint
    print(
        f"Benchmarking {args.num_prompts} requests against {url}: request rate "
        f"{args.request_rate}, burstiness {args.burstiness}, max concurrency "
        f"{args.max_concurrency or 'unlimited'}, {args.num_warmups} warmups"
    )
    outputs, benchmark_start, duration = asyncio.run(_benchmark(args, url, requests, payloads))
    return report(args, model, outputs, benchmark_start, duration)


def report(
    args: argparse.Namespace,
    model: str,
    outputs: list[RequestTiming],
    benchmark_start: float,
    duration: float,
) -> dict[str, Any]:
    """Prints the table and saves and plots the result, as --save-result etc. ask."""
    selected_metrics, percentiles = check_args(args)
    figures = compute_metrics(outputs, benchmark_start, duration, percentiles)

    errors = Counter(out.error for out in outputs if not out.success)
    if errors:
        print(f"{errors.total()} requests failed; the first errors:")
        for error, count in list(errors.items())[:MAX_ERRORS_SHOWN]:
            print(f"  {error} (x{count})")
    print(format_table(figures, args.max_concurrency, selected_metrics, percentiles))

    result = {**_settings(args, model), **figures}
    if args.save_detailed:
        result.update(_per_request(outputs, benchmark_start))
    if args.save_result or args.save_detailed:
        path = save_result(result, args.result_dir, args.result_filename or _result_name(result))
        print(f"Result saved to {path}")
    if args.plot:
        # Imported here: matplotlib is slow to load and only --plot needs it.
        from pipellm.bench.plot import plot_run

        plot_run(
            outputs, benchmark_start, args.plot, title=f"{model} ({args.label or args.backend})"
        )
        print(f"Plot saved to {args.plot}")
    return result


def check_args(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """Fail early on bad settings; returns the selected metrics and percentiles."""
    if args.num_prompts < 1:
        raise SystemExit(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.num_warmups < 0:
        raise SystemExit(f"--num-warmups must be 0 or more, got {args.num_warmups}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise SystemExit(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise SystemExit(f"--burstiness must be > 0 (1 = Poisson), got {args.burstiness}")
    if args.backend == "openai-chat" and not is_chat_endpoint(args.endpoint):
        raise SystemExit(
            f"--backend openai-chat sends chat messages, but --endpoint is {args.endpoint}; "
            "add --endpoint /v1/chat/completions"
        )
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path FILE.json (a local file)")
    selected = [name.strip() for name in args.percentile_metrics.split(",") if name.strip()]
    unknown = sorted(set(selected) - set(METRICS))
    if unknown:
        raise SystemExit(f"--percentile-metrics: unknown {unknown}; choose from {list(METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError as e:
        raise SystemExit(f"--metric-percentiles must be numbers like 50,99: {e}") from e
    if not all(0 <= p <= 100 for p in percentiles):
        raise SystemExit(f"--metric-percentiles must lie in [0, 100], got {percentiles}")
    return selected, percentiles


def sample_requests(
    args: argparse.Namespace, tokenizer: TokenizerLike, count: int
) -> list[SampleRequest]:
    # Warmups are drawn after the timed prompts, so --num-warmups never changes those.
    if args.dataset_name == "sharegpt":
        return sample_sharegpt_requests(
            tokenizer, args.dataset_path, count, args.seed, args.sharegpt_output_len
        )
    return sample_random_requests(
        tokenizer,
        count,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_prefix_len,
        args.seed,
    )


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """Send times, in seconds after the start; all 0 for an infinite rate.

    Gaps are gamma-distributed with shape burstiness and mean 1 / request_rate (shape 1 is a
    Poisson process); the first request goes at 0.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1 / (request_rate * burstiness), size=num_requests)
    return [0.0, *np.cumsum(gaps[: num_requests - 1]).tolist()]


async def _benchmark(
    args: argparse.Namespace, url: str, requests: list[SampleRequest], payloads: list[dict]
) -> tuple[list[RequestTiming], float, float]:
    """Warmups, then the timed run; returns its outputs, start time and duration."""
    # No connection cap of aiohttp's own: the semaphore is the only limit on concurrency.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        sender = _Sender(http, url, _auth_headers(), args.max_concurrency or len(requests))
        pairs = list(zip(requests, payloads, strict=True))
        timed, warmups = pairs[: args.num_prompts], pairs[args.num_prompts :]
        if warmups:
            warm_outputs, _, _ = await sender.send_all(warmups, [0.0] * len(warmups), None)
            failed = sum(not out.success for out in warm_outputs)
            print(f"Warmup done: {len(warmups)} requests, {failed} failed")
        offsets = arrival_offsets(len(timed), args.request_rate, args.burstiness, args.seed)
        with tqdm(total=len(timed), disable=args.disable_tqdm) as bar:
            return await sender.send_all(timed, offsets, bar)


class _Sender:
    """Sends batches of requests on a schedule, at most max_concurrency in flight."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, headers: dict, max_concurrency: int
    ) -> None:
        self.http = http
        self.url = url
        self.headers = headers
        self.semaphore = asyncio.Semaphore(max_concurrency)

    async def send_all(
        self, batch: list[tuple[SampleRequest, dict]], offsets: list[float], bar: tqdm | None
    ) -> tuple[list[RequestTiming], float, float]:
        """Send each request at start + its offset; returns outputs, start and duration."""
        start = time.perf_counter()
        outputs = await asyncio.gather(
            *(
                self._send_at(start + offset, request, payload, bar)
                for (request, payload), offset in zip(batch, offsets, strict=True)
            )
        )
        return list(outputs), start, time.perf_counter() - start

    async def _send_at(
        self, send_time: float, request: SampleRequest, payload: dict, bar: tqdm | None
    ) -> RequestTiming:
        await asyncio.sleep(send_time - time.perf_counter())
        async with self.semaphore:
            out = await send_request(self.http, self.url, payload, request.prompt_len, self.headers)
        if bar is not None:
            bar.update()
        return out


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _auth_headers() -> dict[str, str]:
    # Same convention as the OpenAI clients: the key, if any, comes from the environment.
    api_key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The run's settings, as the result file records them."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "endpoint": args.endpoint,
        "label": args.label or args.backend,
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        # JSON has no infinity; the familiar tool writes the string "inf".
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "num_warmups": args.num_warmups,
        "seed": args.seed,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "random_prefix_len": args.random_prefix_len,
    }


def _per_request(outputs: list[RequestTiming], benchmark_start: float) -> dict[str, list]:
    """The --save-detailed lists, one entry per timed request in dataset order; times in s."""
    return {
        "input_lens": [out.prompt_len for out in outputs],
        "output_lens": [out.output_tokens for out in outputs],
        "start_times": [out.start_time - benchmark_start for out in outputs],
        "ttfts": [out.ttft if out.success else 0.0 for out in outputs],
        "itls": [out.itl for out in outputs],
        "e2els": [out.latency for out in outputs],
        "generated_texts": [out.generated_text for out in outputs],
        "errors": [out.error for out in outputs],
    }


def _result_name(result: dict[str, Any]) -> str:
    concurrency = result["max_concurrency"]
    concurrency_part = f"-concurrency{concurrency}" if concurrency else ""
    model_name = result["model_id"].rstrip("/").split("/")[-1]
    return (
        f"{result['label']}-{result['request_rate']}qps{concurrency_part}-{model_name}-"
        f"{result['date']}.json"
    )


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(cli)
    main(cli.parse_args())
