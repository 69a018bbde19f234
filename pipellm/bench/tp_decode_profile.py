"""Where a tensor-parallel decode step's time goes, engine side and per rank, beside one
process with 2 threads: the real engine (EngineCore), the built-in SmolLM2 (or --model).

For each configuration and each batch size N in --seqs, N random prompts of --input-len
tokens decode --output-len tokens together; only the steps that decode all N sequences
count (medians). Timers (time.monotonic, one clock for every process of the host) wrap:
  engine: scheduling, the executor's submit (pickling and sending the schedule), the wait
          for the result, applying it;
  ranks:  the schedule's arrival (the bytes read from the pipe, or from the shared-memory
          broadcast of the tensor-parallel driver) and unpickling, preparing
          the batch, the forward pass (its all-reduces apart: their time includes the wait for
          the slower rank), the logits (with their all-gather; under TP, greedy rows
          gather only each rank's best token), sampling, sending the result.
"Hand-over" is from the end of the engine's send to the rank holding the bytes; "return"
is from the rank's send to the engine's main thread holding the result. A rank in the
engine's own process (no pipe) shows no hand-over.

  .venv/bin/python -m pipellm.bench.tp_decode_profile [--seqs 1,8 --output-len 64]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DIR_ENV = "PIPELLM_TP_PROFILE_DIR"

# Per micro-batch id: phase -> seconds (accumulated) or timestamp ("at_*").
RECORDS: dict[int, dict[str, float]] = collections.defaultdict(
    lambda: collections.defaultdict(float)
)
CURRENT: list[int] = [-1]  # the micro-batch this process is working on


def _add(name: str, seconds: float) -> None:
    RECORDS[CURRENT[0]][name] += seconds


def _timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(name, time.monotonic() - started)

    return wrapper


OPS_ENV = "PIPELLM_TP_PROFILE_OPS"


def _instrument_ops(model) -> None:
    """Per-op timers (each adds ~1 us a call): the projections, attention, RoPE + cache
    writes, norms and SiLU; what the forward spends outside them is Python glue."""
    import pipellm.model.llama as llama

    llama.rotate_and_cache = _timed("op rope_cache", llama.rotate_and_cache)
    llama.paged_attention = _timed("op attention", llama.paged_attention)
    llama.silu_and_mul = _timed("op silu", llama.silu_and_mul)
    llama.RMSNorm.forward = _timed("op norm", llama.RMSNorm.forward)
    llama.RMSNorm.add_and_norm = _timed("op norm", llama.RMSNorm.add_and_norm)
    for layer in model.layers:
        for module in (layer.self_attn, layer.mlp):
            for name, child in module.named_children():
                child.forward = _timed(f"op {name}", child.forward)


def _instrument_worker() -> None:
    """Timers on the rank side; the classes are patched, so ranks made later get them."""
    import pipellm.worker.worker as worker_module
    from pipellm.model.llama import LlamaStage
    from pipellm.parallel.shm_comm import ShmComm
    from pipellm.worker.model_runner import ModelRunner
    from pipellm.worker.worker import StageWorker

    execute = StageWorker.execute

    def timed_execute(self, scheduler_output, hidden_in=None):
        CURRENT[0] = scheduler_output.micro_batch_id
        record = RECORDS[CURRENT[0]]
        record["at_execute"] = time.monotonic()
        try:
            return execute(self, scheduler_output, hidden_in)
        finally:
            record["at_executed"] = time.monotonic()
            record["execute"] = record["at_executed"] - record["at_execute"]

    StageWorker.execute = timed_execute
    if os.environ.get(OPS_ENV) == "1":
        init = StageWorker.__init__

        def instrumented_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            _instrument_ops(self.model)

        StageWorker.__init__ = instrumented_init
    ModelRunner.prepare = _timed("prepare", ModelRunner.prepare)
    LlamaStage.forward = _timed("forward", LlamaStage.forward)
    LlamaStage.compute_logits = _timed("logits", LlamaStage.compute_logits)
    LlamaStage.greedy_tokens = _timed("logits", LlamaStage.greedy_tokens)  # TP's greedy rows
    worker_module.sample = _timed("sample", worker_module.sample)
    ShmComm.all_reduce_ = _timed("all_reduce", ShmComm.all_reduce_)
    ShmComm.all_gather = _timed("all_gather", ShmComm.all_gather)
    broadcast_recv = ShmComm.broadcast_recv
    received = [0]  # schedules arrive in submission order: the i-th is micro-batch i's

    def timed_broadcast_recv(self, root: int = 0) -> bytes:
        data = broadcast_recv(self, root)
        RECORDS[received[0]]["at_received"] = time.monotonic()
        received[0] += 1
        return data

    ShmComm.broadcast_recv = timed_broadcast_recv


class _TimedConn:
    """A rank's pipe, timing each schedule's arrival and unpickling and each result's send.
    Messages arrive in submission order, so the i-th is micro-batch i's schedule."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._received = 0

    def recv_bytes(self):
        data = self._conn.recv_bytes()
        record = RECORDS[self._received]
        record["at_received"] = time.monotonic()
        self._received += 1
        return data

    def poll(self, *args):
        return self._conn.poll(*args)

    def send(self, obj) -> None:
        record = RECORDS[getattr(obj, "micro_batch_id", -1)]
        record["at_send"] = time.monotonic()
        self._conn.send(obj)
        record["send"] = time.monotonic() - record["at_send"]

    def __getattr__(self, name):
        return getattr(self._conn, name)


def _dump(name: str) -> None:
    path = Path(os.environ[DIR_ENV]) / f"{name}.json"
    path.write_text(json.dumps({k: dict(v) for k, v in RECORDS.items()}))


def profiled_stage_main(config, rank, port, conn, parent_pid) -> None:
    """pipellm.executor.mp.stage_main with the timers: the ranks' process target."""
    from pipellm.executor import mp as mp_executor

    _instrument_worker()
    mp_executor.stage_main(config, rank, port, _TimedConn(conn), parent_pid)
    _dump(f"rank{rank}")


def profiled_rank_main(config, tp_rank, segment, conn, parent_pid) -> None:
    """pipellm.executor.tp_driver.rank_main with the timers (ranks 1.. of one stage)."""
    from pipellm.executor import tp_driver

    _instrument_worker()
    tp_driver.rank_main(config, tp_rank, segment, _TimedConn(conn), parent_pid)
    _dump(f"rank{tp_rank}")


def _instrument_engine(core) -> None:
    """Timers on the engine side (its own process)."""
    from pipellm.executor.pending import PendingOutputs

    scheduler, executor = core.scheduler, core.executor
    schedule, submit = scheduler.schedule, executor.submit

    def timed_schedule():
        started = time.monotonic()
        out = schedule()
        if out is not None:
            RECORDS[out.micro_batch_id]["schedule"] = time.monotonic() - started
            RECORDS[out.micro_batch_id]["at_schedule"] = started
        return out

    def timed_submit(scheduler_output):
        record = RECORDS[scheduler_output.micro_batch_id]
        record["at_submit"] = time.monotonic()
        record["pickle_bytes"] = len(pickle.dumps(scheduler_output, pickle.HIGHEST_PROTOCOL))
        future = submit(scheduler_output)
        record["at_submitted"] = time.monotonic()
        record["submit"] = record["at_submitted"] - record["at_submit"]
        return future

    scheduler.schedule, executor.submit = timed_schedule, timed_submit
    apply = core._apply

    def timed_apply(scheduler_output, model_output):
        record = RECORDS[scheduler_output.micro_batch_id]
        record["at_apply"] = time.monotonic()
        out = apply(scheduler_output, model_output)
        record["apply"] = time.monotonic() - record["at_apply"]
        return out

    core._apply = timed_apply
    resolve = PendingOutputs.resolve_oldest

    def timed_resolve(self, output):
        RECORDS[output.micro_batch_id]["at_resolved"] = time.monotonic()
        return resolve(self, output)

    PendingOutputs.resolve_oldest = timed_resolve


def _run(engine_args: dict, args: argparse.Namespace, seqs: int, out_dir: str) -> dict:
    """One engine, one batch size: the per-step records of the engine and of each rank."""
    from pipellm.config import EngineConfig
    from pipellm.engine.core import EngineCore
    from pipellm.executor import mp as mp_executor
    from pipellm.executor import tp_driver
    from pipellm.sampling_params import SamplingParams

    RECORDS.clear()
    os.environ[DIR_ENV] = out_dir
    config = EngineConfig(
        model=args.model,
        max_num_seqs=max(8, seqs),
        max_model_len=args.input_len + args.output_len + 16,
        enable_prefix_caching=False,
        **engine_args,
    )
    # The process targets, looked up when the executor starts its processes.
    originals = mp_executor.stage_main, tp_driver.rank_main
    mp_executor.stage_main, tp_driver.rank_main = profiled_stage_main, profiled_rank_main
    try:
        core = EngineCore(config)
    finally:
        mp_executor.stage_main, tp_driver.rank_main = originals
    _instrument_engine(core)
    rng = random.Random(0)
    vocab = config.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    decode_steps: list[int] = []  # micro-batches that had a core.step() to themselves
    try:
        for i in range(seqs):
            core.add_request(str(i), [rng.randrange(vocab) for _ in range(args.input_len)], params)
        while core.has_unfinished_requests():
            known = {k for k, v in RECORDS.items() if "at_submit" in v}
            started = time.monotonic()
            core.step()
            ended = time.monotonic()
            new = [k for k, v in RECORDS.items() if "at_submit" in v and k not in known]
            if len(new) == 1 and not core.in_flight:  # P = 1: scheduled, ran and applied
                RECORDS[new[0]]["at_step_start"] = started
                RECORDS[new[0]]["at_step_end"] = ended
                decode_steps.append(new[0])
    finally:
        core.shutdown()
    engine = {k: dict(v) for k, v in RECORDS.items()}
    ranks = {}
    for path in sorted(Path(out_dir).glob("rank*.json")):
        ranks[path.stem] = {int(k): v for k, v in json.loads(path.read_text()).items()}
        path.unlink()
    if "rank0" not in ranks:  # rank 0 (or the only worker) ran in the engine's process
        ranks = {"in-process": engine, **ranks}
    # Pure decode steps of all `seqs` sequences: the rank saw exactly `seqs` rows, 1 each.
    return {"engine": engine, "ranks": ranks, "steps": decode_steps}


def _summary(result: dict, seqs: int, skip: int) -> dict[str, dict[str, float]]:
    """Median ms per phase over the decode steps (the first `skip` decode steps dropped)."""
    engine, ranks = result["engine"], result["ranks"]
    ids = sorted(result["steps"])
    # Decode steps: those whose schedule pickles to the size of a decode step of `seqs`
    # requests, i.e. after every prefill; the engine's records say which came after them.
    first_decode = _first_decode(result, seqs)
    ids = [i for i in ids if i >= first_decode][skip:-1]
    rows: dict[str, dict[str, float]] = {}

    def median(values: list[float]) -> float:
        return statistics.median(values) * 1e3 if values else float("nan")

    e = [engine[i] for i in ids]
    rows["engine"] = {
        "step": median([r["at_step_end"] - r["at_step_start"] for r in e]),
        "schedule": median([r["schedule"] for r in e]),
        "submit": median([r["submit"] for r in e]),
        "wait": median([r["at_apply"] - r["at_submitted"] for r in e]),
        "apply": median([r["apply"] for r in e]),
    }
    for name, rank in ranks.items():
        rs = [(engine[i], rank[i]) for i in ids if i in rank]
        row = {
            key: median([r.get(key, 0.0) for _, r in rs])
            for key in ("execute", "prepare", "forward", "all_reduce", "logits", "all_gather")
        }
        row["sample"] = median([r.get("sample", 0.0) for _, r in rs])
        if name != "in-process":
            row["hand-over"] = median([r["at_received"] - e["at_submit"] for e, r in rs])
            row["recv->execute"] = median([r["at_execute"] - r["at_received"] for _, r in rs])
        if "at_send" in (rs[0][1] if rs else {}):
            row["return"] = median([e["at_apply"] - r["at_send"] for e, r in rs if "at_send" in r])
            row["reader"] = median(
                [e["at_resolved"] - r["at_send"] for e, r in rs if "at_send" in r]
            )
        row["forward w/o all-reduce"] = row["forward"] - row["all_reduce"]
        ops = sorted({k for _, r in rs for k in r if k.startswith("op ")})
        for op in ops:
            row[op] = median([r.get(op, 0.0) for _, r in rs])
        if ops:
            row["glue"] = row["forward w/o all-reduce"] - sum(row[op] for op in ops)
        rows[name] = row
    return rows


def _first_decode(result: dict, seqs: int) -> int:
    """The first micro-batch after the prompts' prefills: the prompts go in one step here
    (seqs x input_len tokens fit max_num_batched_tokens), so it is the second."""
    del seqs
    return min(result["steps"]) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--seqs", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--skip", type=int, default=4, help="first decode steps not counted")
    parser.add_argument(
        "--only", default="dt", help="d: 1 process, 2 threads; t: TP=2, 1 thread per rank"
    )
    parser.add_argument("--ops", action="store_true", help="time each op too (adds ~1 us a call)")
    args = parser.parse_args()
    if args.ops:
        os.environ[OPS_ENV] = "1"  # the ranks' processes inherit it
    setups = {
        "d": ("1 process, 2 threads", dict(num_threads=2)),
        "t": ("TP=2, 1 thread per rank", dict(tensor_parallel_size=2, num_threads=1)),
    }
    _instrument_worker()  # the in-process worker's (the ranks' processes do their own)
    with tempfile.TemporaryDirectory(prefix="pipellm-tp-profile-") as out_dir:
        for seqs in (int(s) for s in args.seqs.split(",")):
            print(f"\n{seqs} sequence(s) decoding, ms per decode step (medians)")
            for key in args.only:
                label, engine_args = setups[key]
                rows = _summary(_run(engine_args, args, seqs, out_dir), seqs, args.skip)
                print(f"  {label}")
                for name, row in rows.items():
                    cells = "  ".join(f"{k} {v:.2f}" for k, v in row.items())
                    print(f"    {name:10s} {cells}")


if __name__ == "__main__":
    main()
