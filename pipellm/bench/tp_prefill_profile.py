"""Where a tensor-parallel prefill step spends its time: per op and per rank, TP = 2 with one
thread per rank against one process with 2 threads, on the same prompts.

Each configuration loads the built-in SmolLM2 (or --model) as the engine's workers do
(StageWorker, one process per rank, 1 thread each, pinned to cores 0 and 1), then runs
--prompts fresh prompts of --len random tokens as one prefill step, --iters times after a
warm-up. Timers wrap the projections, attention, RoPE + cache writes, norms, SiLU and the
collectives; a rank that waits at an all-reduce for a slower peer shows it in its
`all_reduce` column, so the difference between the ranks' columns is the imbalance.

  .venv/bin/python -m pipellm.bench.tp_prefill_profile [--prompts 2 --len 1024 --iters 2]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pipellm.worker.net import free_port

TIMES: dict[str, float] = collections.defaultdict(float)


def _timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - started

    return wrapper


def _instrument(model: torch.nn.Module) -> None:
    import pipellm.model.llama as llama

    llama.rotate_and_cache = _timed("rope_cache", llama.rotate_and_cache)
    llama.paged_attention = _timed("attention", llama.paged_attention)
    llama.silu_and_mul = _timed("silu", llama.silu_and_mul)
    llama.RMSNorm.forward = _timed("norm", llama.RMSNorm.forward)
    llama.RMSNorm.add_and_norm = _timed("norm", llama.RMSNorm.add_and_norm)
    if model.comm is not None:
        model.comm.all_reduce_ = _timed("all_reduce", model.comm.all_reduce_)
        model.comm.all_gather = _timed("all_gather", model.comm.all_gather)
    for layer in model.layers:
        for module in (layer.self_attn, layer.mlp):
            for name, child in module.named_children():
                child.forward = _timed(name, child.forward)


def _rank_main(tp_size: int, rank: int, port: int, args: argparse.Namespace, out: mp.Queue):
    from pipellm.config import EngineConfig
    from pipellm.protocol import ScheduledRequest, SchedulerOutput
    from pipellm.sampling_params import SamplingParams
    from pipellm.worker.worker import StageWorker

    threads = 1 if tp_size > 1 else 2
    torch.set_num_threads(threads)
    comm = None
    if tp_size > 1:
        from pipellm.parallel.tp_group import make_tensor_parallel_comm

        os.sched_setaffinity(0, {rank % os.cpu_count()})
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp_size
        )
        comm = make_tensor_parallel_comm(1, tp_size, 0)
    config = EngineConfig(
        model=args.model,
        tensor_parallel_size=tp_size,
        num_threads=threads,
        max_num_seqs=max(8, args.prompts),
        max_num_batched_tokens=args.prompts * args.len,
        max_model_len=args.len + 16,
        enable_prefix_caching=False,
    )
    worker = StageWorker(config, 0, rank, comm)
    _instrument(worker.model)
    blocks = -(-args.len // config.block_size)
    vocab = config.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)
    steps, previous = [], []
    for step in range(args.iters + 1):  # the first is a warm-up
        requests = [
            ScheduledRequest(
                request_id=f"{step}-{p}",
                num_computed_tokens=0,
                num_scheduled_tokens=args.len,
                new_token_ids=[rng.randrange(vocab) for _ in range(args.len)],
                new_block_ids=list(range(p * blocks, (p + 1) * blocks)),
                sampling_params=params,
                sample=True,
            )
            for p in range(args.prompts)
        ]
        batch = SchedulerOutput(step, requests, freed_request_ids=previous)
        previous = [r.request_id for r in requests]
        if comm is not None:
            dist.barrier()
        TIMES.clear()
        started = time.perf_counter()
        worker.execute(batch)
        TIMES["step"] = time.perf_counter() - started
        steps.append(dict(TIMES))
    out.put((rank, steps[1:]))
    if comm is not None:
        comm.close()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--len", type=int, default=1024, help="tokens per prompt")
    parser.add_argument("--iters", type=int, default=2, help="timed steps (medians)")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    rows: dict[str, dict[str, float]] = {}
    for label, tp_size in (("1 process, 2 threads", 1), ("TP=2", 2)):
        out = context.Queue()
        port = free_port()
        ranks = [
            context.Process(target=_rank_main, args=(tp_size, r, port, args, out))
            for r in range(tp_size)
        ]
        for process in ranks:
            process.start()
        results = sorted(out.get(timeout=1200) for _ in ranks)
        for process in ranks:
            process.join()
        for rank, steps in results:
            name = label if tp_size == 1 else f"{label} rank {rank}"
            keys = {key for step in steps for key in step}
            rows[name] = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
    columns = sorted({k for row in rows.values() for k in row} - {"step"})
    columns.insert(0, "step")
    print(f"{args.prompts} x {args.len} tokens, one prefill step, ms (median of {args.iters})")
    print(f"{'':22s}" + "".join(f"{c:>13s}" for c in columns))
    for name, row in rows.items():
        print(f"{name:22s}" + "".join(f"{row.get(c, 0.0) * 1e3:13.1f}" for c in columns))
    threads = rows["1 process, 2 threads"]["step"]
    slowest = max(row["step"] for name, row in rows.items() if name.startswith("TP"))
    print(f"step time TP=2 / 2 threads: {slowest / threads:.2f}x")


if __name__ == "__main__":
    main()
