"""All-reduce latency between the two ranks of a tensor-parallel group on one host: pipellm's
shared-memory communicator vs gloo, by size, one process per core with 1 thread each.

The sizes are a layer's all-reduce at decode (1 and 16 rows of SmolLM2's 576) and at prefill
(256 and 2048 rows, and 8192: pp_scaling's 8 prompts of 1024 tokens in one step), float32.
The two communicators are timed alternately (shm, gloo, shm, gloo ...) in the same two
processes; prints the median per call and the ratio.

  .venv/bin/python benchmarks/tp_allreduce.py [--iters 2000 --rounds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist

from pipellm.worker.net import free_port

ROWS = (1, 16, 256, 2048, 8192)
HIDDEN = 576


def _rank_main(rank: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    from pipellm.parallel.comm import GlooComm
    from pipellm.parallel.shm_comm import ShmComm

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    comms = {"shm": ShmComm.create(group, [0, 1], 0), "gloo": GlooComm(group, [0, 1])}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for rows in ROWS:
            iters = max(20, args.iters * 16 // max(rows, 16))
            for name, comm in comms.items():
                x = torch.randn(rows, HIDDEN)
                for _ in range(10):  # warm up
                    comm.all_reduce_(x)
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(iters):
                    comm.all_reduce_(x)
                elapsed = (time.perf_counter() - start) / iters
                times.setdefault((name, rows), []).append(elapsed)
    if rank == 0:
        results.put({key: statistics.median(values) for key, values in times.items()})
    comms["shm"].close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000, help="calls per timing at 16 rows")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank_main, args=(r, port, args, results)) for r in range(2)]
    for process in ranks:
        process.start()
    medians = results.get(timeout=600)
    for process in ranks:
        process.join()
    print(f"{'rows x 576 float32':>20} {'bytes':>10} {'shm us':>9} {'gloo us':>9} {'gloo/shm':>9}")
    for rows in ROWS:
        shm, gloo = medians[("shm", rows)] * 1e6, medians[("gloo", rows)] * 1e6
        print(f"{rows:>20} {rows * HIDDEN * 4:>10} {shm:>9.1f} {gloo:>9.1f} {gloo / shm:>8.1f}x")


if __name__ == "__main__":
    main()
