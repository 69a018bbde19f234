"""Start-up time of pipellm: `LLM(...)` construction (built-in model, Gemma 3 270M),
`pipellm serve -pp 2` from launch to a healthy /health, and two parts every process pays
(parsing a GGUF header, loading the built kernel library), for one or more source trees
taking turns in one run (e.g. a checkout of an older commit against this one).

Each measurement is a fresh process (as a user's is), run with the tree as its working folder
and on PYTHONPATH, and with the tree's own kernel build folder (TREE/.torch_extensions: build
it first with `python -m pipellm.kernels.cpu_kernels` there). Prints each case's median per
tree and its ratio to the first tree.

  .venv/bin/python benchmarks/startup_costs.py --tree old=/tmp/old-checkout --tree new=. \\
      --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

_CONSTRUCT = """
import sys, time
started = time.perf_counter()
from pipellm import LLM
with LLM(*sys.argv[1:2], **({"max_model_len": 1024} if sys.argv[1:2] else {})) as llm:
    print("constructed", time.perf_counter() - started)
"""
# Parts of a start, each timed in a fresh process of the tree: the GGUF header (config,
# tokenizer and stages read it) and loading the already-built kernel library.
_HEADER = """
import sys, time
from pathlib import Path
started = time.perf_counter()
from pipellm.loader.gguf_file import GGUFFile
GGUFFile(Path(sys.argv[1]))
print("constructed", time.perf_counter() - started)
"""
_KERNELS = """
import time
import torch
started = time.perf_counter()
from pipellm.kernels.cpu_kernels import chosen_level, ops
ops(chosen_level())
print("constructed", time.perf_counter() - started)
"""
_LISTENING = re.compile(r"listening on http://\S+?:(\d+)")
CASES = ("header-smollm2", "header-gemma", "kernels", "builtin", "gemma", "serve")


def _environment(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["TORCH_EXTENSIONS_DIR"] = str(tree / ".torch_extensions")
    return env


def construct_seconds(tree: Path, model: list[str], script: str = _CONSTRUCT) -> float:
    """Seconds the script reports (from its first pipellm import to its end)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *model],
        cwd=tree,
        env=_environment(tree),
        capture_output=True,
        text=True,
        timeout=600,
    )
    match = re.search(r"constructed ([\d.]+)", done.stdout)
    if match is None:
        raise RuntimeError(f"the measurement failed in {tree}:\n{done.stderr[-3000:]}")
    return float(match.group(1))


def serve_seconds(tree: Path) -> float:
    """Seconds from launching `pipellm serve -pp 2` to /health answering 200."""
    command = [sys.executable, "-m", "pipellm.entrypoints.cli", "serve", "-pp", "2"]
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            [*command, "--port", "0"],
            cwd=tree,
            env=_environment(tree),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    text = log.read().decode(errors="replace")
                    raise RuntimeError(f"pipellm serve exited in {tree}:\n{text[-3000:]}")
                log.seek(0)
                match = _LISTENING.search(log.read().decode(errors="replace"))
                if match and _healthy(int(match.group(1))):
                    return time.perf_counter() - started
                time.sleep(0.05)
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _smollm2_path() -> str:
    from pipellm.loader.source import resolve_model

    return str(resolve_model(None).path)


def _gemma_path() -> str:
    from pipellm.loader.registry import find_preset

    path = find_preset("google/gemma-3-270m").find_gguf()
    if path is None:
        raise SystemExit("Gemma 3 270M is not installed (make install installs it)")
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        action="append",
        metavar="NAME=PATH",
        help="a source tree to measure (repeatable; default: this one)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = dict(item.split("=", 1) for item in args.tree or [f"this={here}"])
    trees = {name: Path(path).resolve() for name, path in trees.items()}
    cases = [case for case in args.cases.split(",") if case]
    runs = {
        "header-smollm2": lambda tree: construct_seconds(tree, [_smollm2_path()], _HEADER),
        "header-gemma": lambda tree: construct_seconds(tree, [_gemma_path()], _HEADER),
        "kernels": lambda tree: construct_seconds(tree, [], _KERNELS),
        "builtin": lambda tree: construct_seconds(tree, []),
        "gemma": lambda tree: construct_seconds(tree, [_gemma_path()]),
        "serve": serve_seconds,
    }
    seconds: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for case in cases:
            for name, tree in trees.items():  # taking turns: load drifts hit every tree alike
                value = runs[case](tree)
                seconds.setdefault((case, name), []).append(value)
                print(f"round {round_index + 1} {case:16s} {name:10s} {value:7.2f} s", flush=True)
    first = next(iter(trees))
    print(
        f"\n{'case':16s}" + "".join(f"{name:>14s}" for name in trees) + f"   speed-up over {first}"
    )
    for case in cases:
        medians = {name: statistics.median(seconds[(case, name)]) for name in trees}
        ratios = " ".join(f"{medians[first] / medians[n]:.2f}x" for n in list(trees)[1:])
        row = "".join(f"{medians[name]:12.2f} s" for name in trees)
        print(f"{case:16s}{row}   {ratios}")


if __name__ == "__main__":
    main()
