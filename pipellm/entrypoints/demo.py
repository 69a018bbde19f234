"""`make demo`: serve the built-in model on two pipeline stages, chat with it through the
official OpenAI client, load it with `pipellm bench serve`, stop it, and say where the results
went."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from pipellm.engine.trace_timeline import render_timeline
from pipellm.testing.server_process import ServerProcess

QUESTION = "What is the capital of France?"
NUM_STAGES = 2
# Sized to finish in a few minutes on a 2-core CPU; vLLM issue #27462's run used 256 x 4000 tokens.
BENCH_FLAGS = [
    "--num-prompts", "32",
    "--max-concurrency", "8",
    "--random-input-len", "256",
    "--random-output-len", "32",
    "--num-warmups", "2",
]  # fmt: skip


def run_demo(results_dir: Path = Path("results")) -> None:
    logging.getLogger().setLevel(logging.WARNING)  # the story is told by print(); no HTTP logs
    results_dir.mkdir(parents=True, exist_ok=True)
    log = results_dir / "demo-server.log"
    trace = results_dir / "demo-pipeline.trace.json"
    result = results_dir / "demo-bench.json"
    plot = results_dir / "demo-bench.png"
    timeline = results_dir / "demo-pipeline-timeline.png"
    for stale in (log, trace, result, plot, timeline):
        stale.unlink(missing_ok=True)  # what the end lists must come from this run
    server_flags = ["--pipeline-parallel-size", str(NUM_STAGES), "--max-num-seqs", "8"]
    print(f"starting `pipellm serve {' '.join(server_flags)}` on the built-in model (log: {log})")
    server = ServerProcess([*server_flags, "--trace-file", str(trace)], log)
    with server:  # stops the server on every exit path, Ctrl-C included
        print(f"server ready at {server.base_url}\n")
        print(f"user: {QUESTION}\nassistant: {_ask(server.base_url, QUESTION)}\n")
        bench_args = ["--base-url", server.base_url, *BENCH_FLAGS]
        bench_args += ["--label", f"pipellm-pp{NUM_STAGES}", "--save-result"]
        bench_args += ["--result-dir", str(results_dir), "--result-filename", result.name]
        bench_args += ["--plot", str(plot)]
        print(f"running: pipellm bench serve {' '.join(bench_args)}", flush=True)
        bench = [sys.executable, "-m", "pipellm.entrypoints.cli", "bench", "serve", *bench_args]
        code = subprocess.run(bench, check=False).returncode
        if code != 0:
            print(f"pipellm bench serve failed with exit code {code}")
        busy = _stage_busy(server.base_url)
        print("stopping the server")
        server.stop()  # a graceful stop writes the trace
    if trace.exists():
        title = f"pipellm serve -pp {NUM_STAGES}: stage activity during the demo"
        render_timeline(trace, timeline, title=title)
    print(f"\npipeline stages busy while work was in flight: {busy}")
    print("results:")
    for what, path in (
        ("benchmark result (JSON)", result),
        ("benchmark plot: TTFT, ITL, tokens/s over time (PNG)", plot),
        ("pipeline timeline, one lane per stage (PNG)", timeline),
        ("the same as a trace (open in https://ui.perfetto.dev)", trace),
        ("server log", log),
    ):
        print(f"  {what}: {path if path.exists() else 'not written'}")


def _ask(base_url: str, question: str) -> str:
    import openai  # a dev dependency; `make demo` installs it

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=48,
    )
    return (answer.choices[0].message.content or "").strip()


def _stage_busy(base_url: str) -> str:
    """Per-stage busy fractions from /metrics, e.g. "stage 0 93%, stage 1 95%"."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = re.findall(r'^pipellm:stage_busy_fraction\{.*stage="(\d+)"\} (\S+)$', text, re.M)
    return ", ".join(f"stage {stage} {float(value):.0%}" for stage, value in found) or "unknown"
