"""Stage-to-stage hand-over with tensor parallelism: matching ranks vs rank 0 plus a broadcast.

Two stages of T = 2 ranks each (4 processes, 1 thread each, numbered stage-major as in
pipeline_stage.py; tensor-parallel rank t pinned to core t). After its last all-reduce every
rank of a stage holds the same hidden states [tokens, 576] float32; the next stage's ranks
all need them. Two ways, alternated A B A B in the same processes:
  matching: rank t of stage 0 sends to rank t of stage 1 (T gloo transfers side by side);
            what pipeline_stage.py does
  bcast:    rank 0 of stage 0 sends to rank 0 of stage 1, which broadcasts inside its stage
            over the shared-memory communicator (parallel/shm_comm.py)
Each timing is one hand-over plus a one-float ack from every stage-1 rank back to its sender
(the same acks in both ways): the time until every rank of the next stage holds the hidden
states, plus the ack's return. Prints the median per hand-over in us and bcast / matching.

  .venv/bin/python -m pipellm.bench.tp_transfer [--tokens 1,16,256,2048 --iters 300 --rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist

from pipellm.executor.mp import join_or_kill
from pipellm.worker.net import free_port

TP = 2
HIDDEN = 576
WARMUP = 20


def _matching(rank: int, x: torch.Tensor, ack: torch.Tensor, comm) -> None:
    stage, t = divmod(rank, TP)
    if stage == 0:
        dist.send(x, dst=TP + t)
        dist.recv(ack, src=TP + t)
    else:
        dist.recv(x, src=t)
        dist.send(ack, dst=t)


def _bcast(rank: int, x: torch.Tensor, ack: torch.Tensor, comm) -> None:
    stage, t = divmod(rank, TP)
    if stage == 0:
        if t == 0:
            dist.send(x, dst=TP)
            for peer in range(TP):
                dist.recv(ack, src=TP + peer)
        return  # stage 0's other ranks only wait (they hold the same states)
    if t == 0:
        dist.recv(x, src=0)
    else:
        x.zero_()  # a broadcast as a sum: rank 0's states plus zeros, the same bits
    comm.all_reduce_(x)
    dist.send(ack, dst=0)


WAYS = {"matching": _matching, "bcast": _bcast}


def _rank_main(rank: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    from pipellm.parallel.tp_group import make_tensor_parallel_comm

    # Tensor-parallel rank t on core t: each stage's ranks spread over the cores, as T x P
    # ranks on T cores would run (here T = 2 = the cores).
    os.sched_setaffinity(0, {(rank % TP) % os.cpu_count()})
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2 * TP
    )
    comm = make_tensor_parallel_comm(2, TP, rank // TP)
    ack = torch.zeros(1)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for tokens in args.token_counts:
            x = torch.randn(tokens, HIDDEN)
            for name, way in WAYS.items():
                iters = max(30, args.iters * 16 // max(tokens, 16))
                dist.barrier()
                samples = []
                for i in range(WARMUP + iters):
                    started = time.perf_counter()
                    way(rank, x, ack, comm)
                    if i >= WARMUP:
                        samples.append(time.perf_counter() - started)
                times.setdefault((name, tokens), []).append(statistics.median(samples))
    if rank == 0:
        results.put({key: statistics.median(values) for key, values in times.items()})
    dist.barrier()
    comm.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,256,2048", help="hidden-state rows")
    parser.add_argument("--iters", type=int, default=300, help="hand-overs per timing at 16 rows")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    args = parser.parse_args()
    args.token_counts = [int(t) for t in args.tokens.split(",")]
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_rank_main, args=(r, port, args, results)) for r in range(2 * TP)
    ]
    for process in ranks:
        process.start()
    try:
        medians = results.get(timeout=600)
    finally:
        join_or_kill(ranks, timeout_s=30)
    print(f"T = {TP}, 2 stages, {2 * TP} processes on {os.cpu_count()} cores")
    print(f"{'tokens x 576 fp32':>18} {'matching us':>12} {'bcast us':>10} {'bcast/matching':>15}")
    for tokens in args.token_counts:
        a, b = medians[("matching", tokens)] * 1e6, medians[("bcast", tokens)] * 1e6
        print(f"{tokens:>18} {a:>12.1f} {b:>10.1f} {b / a:>14.2f}x")


if __name__ == "__main__":
    main()
