"""What one micro-batch's hand-over costs: stage to stage on one host vs across two hosts.

A micro-batch leaves a stage as its hidden states [tokens, hidden] (float32) and a small
tensor of stage times, sent with torch.distributed over gloo, as pipeline_stage.py does.
Two processes ping-pong those tensors; half the round trip is the one-way cost. Setups,
alternated A B A B:
  local: both processes on this host, over loopback (the mp backend; Ray on one host)
  hosts: one process in each of two network namespaces joined by a veth pair (root needed):
         real separate network stacks, but the "wire" is this machine's memory, so a real
         network adds its own latency and bandwidth limit on top (see docs/pipeline.md)

  .venv/bin/python -m pipellm.bench.pp_transfer [--tokens 4,128,1024 --hidden 576 --iters 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from pipellm.worker.net import LOOPBACK, free_port
from pipellm.worker.process_group import Rendezvous, join_pipeline_group

WARMUP = 20
PORT = 29500  # in a fresh network namespace every port is free


def endpoint(args: argparse.Namespace) -> None:
    """One side of the ping-pong; rank 0 prints the one-way times (us) as JSON."""
    torch.set_num_threads(1)
    rank = args.endpoint
    join_pipeline_group(Rendezvous(args.host, args.port, args.local), rank, 2)
    result = {}
    for tokens in args.token_counts:
        hidden = torch.randn(tokens, args.hidden)
        times = torch.zeros(1, 2, dtype=torch.float64)
        samples = []
        for i in range(WARMUP + args.iters):
            started = time.perf_counter()
            if rank == 0:
                dist.send(hidden, 1)
                dist.send(times, 1)
                dist.recv(hidden, 1)
                dist.recv(times, 1)
            else:
                dist.recv(hidden, 0)
                dist.recv(times, 0)
                dist.send(hidden, 0)
                dist.send(times, 0)
            if i >= WARMUP:
                samples.append((time.perf_counter() - started) / 2 * 1e6)
        result[tokens] = statistics.median(samples)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(result), flush=True)


def run_pair(args: argparse.Namespace, hosts: list[list[str]], addresses: list[str]) -> dict:
    """Starts both endpoints (each behind its host's command prefix); rank 0's times."""
    port = PORT if addresses[0] != LOOPBACK else free_port()
    common = ["--host", addresses[0], "--port", str(port), "--hidden", str(args.hidden)]
    common += ["--tokens", args.tokens, "--iters", str(args.iters)]
    procs = [
        subprocess.Popen(
            [*hosts[rank], sys.executable, __file__, "--endpoint", str(rank), *common]
            + ["--local", addresses[rank]],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        out, _ = procs[0].communicate(timeout=300)
        procs[1].wait(timeout=30)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4,128,1024", help="tokens per micro-batch")
    parser.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M: 576")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--endpoint", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host", default=LOOPBACK, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--local", default=LOOPBACK, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.token_counts = [int(t) for t in args.tokens.split(",")]
    if args.endpoint is not None:
        endpoint(args)
        return
    from pipellm.testing.netns_cluster import TwoHostCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"pp_transfer needs two network namespaces: {reason}")
    results: dict[str, list[dict]] = {"local": [], "hosts": []}
    with TwoHostCluster(ray=False) as net:
        in_ns = [["ip", "netns", "exec", ns] for ns in net.namespaces]
        for _ in range(args.repeats):
            results["local"].append(run_pair(args, [[], []], [LOOPBACK, LOOPBACK]))
            results["hosts"].append(run_pair(args, in_ns, net.addresses))
    print(f"{'tokens':>7s} {'bytes':>9s} {'local us':>9s} {'hosts us':>9s} {'ratio':>6s}")
    for tokens in args.token_counts:
        local = statistics.median(r[tokens] for r in results["local"])
        hosts = statistics.median(r[tokens] for r in results["hosts"])
        size = tokens * args.hidden * 4 + 16
        print(f"{tokens:7d} {size:9d} {local:9.1f} {hosts:9.1f} {hosts / local:5.2f}x")


if __name__ == "__main__":
    main()
