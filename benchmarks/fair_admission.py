"""Time to first token of a short request sent while a long prompt prefills, with
--long-prefill-token-threshold off (0) and at its default, side by side.

For each pipeline size, `pipellm serve` runs once per configuration; a request with a
LONG-token prompt and max_tokens 1 is sent, then after --delay seconds a streamed request with
a SHORT-token prompt. Prints each TTFT and the long request's time.

    python benchmarks/fair_admission.py --pp 1 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
import time
from pathlib import Path

from pipellm.config import DEFAULT_LONG_PREFILL_TOKENS
from pipellm.testing.server_process import ServerProcess


def post(port: int, body: dict) -> tuple[float, float]:
    """(seconds to the first streamed token or the reply, seconds to the end)."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    first = None
    while line := response.readline():
        if first is None and line.startswith(b"data: {"):
            first = time.perf_counter() - started
    connection.close()
    total = time.perf_counter() - started
    return first if first is not None else total, total


def measure(model: list[str], pp: int, extra: list[str], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        flags = [*model, "-pp", str(pp), *extra]
        with ServerProcess(flags, Path(folder) / "log") as server:
            post(server.port, {"prompt": [504] * 8, "max_tokens": 1})  # warm-up
            result: dict[str, float] = {}

            def long_request() -> None:
                result["long_s"] = post(
                    server.port, {"prompt": [504] * args.long, "max_tokens": 1}
                )[1]

            thread = threading.Thread(target=long_request)
            thread.start()
            time.sleep(args.delay)
            short = {"prompt": [504] * args.short, "max_tokens": 5, "stream": True}
            result["short_ttft_s"] = post(server.port, short)[0]
            thread.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model to serve (default: the built-in SmolLM2)")
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2], help="pipeline sizes")
    parser.add_argument("--long", type=int, default=8000, help="long prompt's tokens")
    parser.add_argument("--short", type=int, default=5, help="short prompt's tokens")
    parser.add_argument("--delay", type=float, default=3.0, help="seconds between the two")
    parser.add_argument(
        "--thresholds",
        type=int,
        nargs="+",
        default=[0, DEFAULT_LONG_PREFILL_TOKENS],
        help="--long-prefill-token-threshold values to compare (0: no cap; default: off and "
        f"the default, {DEFAULT_LONG_PREFILL_TOKENS})",
    )
    args = parser.parse_args()
    model = [args.model] if args.model else []
    print("pp  threshold  short TTFT s  long request s")
    for pp in args.pp:
        for threshold in args.thresholds:
            flags = ["--long-prefill-token-threshold", str(threshold)]
            result = measure(model, pp, flags, args)
            ttft, long_s = result["short_ttft_s"], result["long_s"]
            print(f"{pp:<3} {threshold:<10} {ttft:<13.2f} {long_s:.2f}", flush=True)


if __name__ == "__main__":
    main()
