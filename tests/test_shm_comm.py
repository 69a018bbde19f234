"""The shared-memory all-reduce / all-gather / broadcast between two processes: exact sums
(every rank the same bits), chunks larger than a slot, other dtypes, broadcasts mixed with
all-reduces, and no segment left when a rank dies."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback

import pytest
import torch

from pipellm.executor.mp import join_or_kill
from pipellm.parallel.shm_comm import (
    PREFIX,
    SHM_DIR,
    SLOT_BYTES,
    shm_comm_available,
    shm_library,
)
from pipellm.worker.net import free_port

pytestmark = pytest.mark.skipif(not shm_comm_available(), reason="no shared-memory kernel")
TIMEOUT_S = 60


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return {
        "decode": torch.randn(16, 576, generator=generator),
        "chunked": torch.randn(SLOT_BYTES // 4 * 2 + 1000, generator=generator),
        "bfloat16": torch.randn(33, 7, generator=generator).bfloat16(),
    }


# Rank 0 sends these in a row (it never waits for rank 1 to take one), an all-reduce between
# the second and third; the long one spans three slots.
BROADCASTS = [b"a schedule", bytes(range(256)) * (SLOT_BYTES // 128 + 1), b"x", b""]


def _wide(rank: int) -> torch.Tensor:
    """Rows of 1000 floats, more of them than one slot holds."""
    return torch.randn(
        SLOT_BYTES // 4000 * 2 + 3, 1000, generator=torch.Generator().manual_seed(rank)
    )


def _picked(width: int) -> torch.Tensor:
    """Columns of 2 ranks' rows side by side: some of each, out of order, one twice."""
    return torch.tensor([2 * width - 1, 0, 5, width + 3, width + 3, width - 1, width])


def _join_group(rank: int, port: int):
    """This process as rank `rank` of a 2-process gloo group, and the group's communicator."""
    import torch.distributed as dist

    from pipellm.parallel.tp_group import make_tensor_parallel_comm

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    return make_tensor_parallel_comm(1, 2, 0)


def _start_pair(target) -> tuple[list[mp.Process], mp.Queue]:
    """Two spawned processes running target(rank, port, results), and their results queue."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=target, args=(r, port, results), daemon=True) for r in range(2)
    ]
    for process in processes:
        process.start()
    return processes, results


def _first_reports(results: mp.Queue) -> dict[int, tuple[str, object]]:
    """Each rank's first (kind, payload), by rank."""
    reports = {}
    for _ in range(2):
        kind, rank, payload = results.get(timeout=TIMEOUT_S)
        reports[rank] = (kind, payload)
    return reports


def _kill_and_expect_named(processes: list[mp.Process], results: mp.Queue, dead: int) -> None:
    """SIGKILLs rank `dead`; the other rank, waiting on it, must raise and name it."""
    os.kill(processes[dead].pid, signal.SIGKILL)
    kind, rank, payload = results.get(timeout=TIMEOUT_S)
    assert (kind, rank) == ("error", 1 - dead)
    assert f"rank {dead} (pid {processes[dead].pid}) is gone" in payload


def _member(rank: int, port: int, results: mp.Queue) -> None:
    """Runs the collectives, reports them; then rank 1 waits to be killed and rank 0
    all-reduces once more, which must raise rather than hang."""
    try:
        comm = _join_group(rank, port)
        out = {name: comm.all_reduce_(x.clone()) for name, x in _inputs(rank).items()}
        # The op itself, as the kernel library registers it (kernels/kernel_ops.py).
        out["decode_op"] = _inputs(rank)["decode"]
        shm_library().shm_all_reduce_(out["decode_op"], comm.handle)
        out["gather"] = comm.all_gather(torch.full((3, 5), float(rank)))
        out["gather_chunked"] = comm.all_gather(_inputs(rank)["chunked"].view(2, -1))
        # Columns picked from the ranks' rows side by side, in and across slot-sized chunks.
        for name, rows in (("columns", _inputs(rank)["decode"]), ("columns_chunked", _wide(rank))):
            out[name] = comm.all_gather_columns(rows, _picked(rows.shape[1]))
        received = []
        for i, message in enumerate(BROADCASTS):
            if i == 2:
                out["after_broadcasts"] = comm.all_reduce_(_inputs(rank)["decode"])
            if rank == 0:
                comm.broadcast_send(message)
            else:
                received.append(comm.broadcast_recv())
        out["after_broadcasts_2"] = comm.all_reduce_(_inputs(rank)["decode"])
        if rank == 1:
            assert received == BROADCASTS, [len(m) for m in received]
        # As numpy arrays: a tensor would travel as a shared fd that dies with this process.
        arrays = {name: x.float().numpy() for name, x in out.items()}
        results.put(("done", rank, (type(comm).__name__, arrays)))
        if rank == 1:
            signal.pause()  # killed by the test
        comm.all_reduce_(torch.ones(16, 576))
        results.put(("summed", rank, None))
    except Exception:
        results.put(("error", rank, traceback.format_exc()))


def _our_segments(processes: list[mp.Process]) -> list[str]:
    pids = {str(p.pid) for p in processes}
    names = [path.name for path in SHM_DIR.glob(f"{PREFIX}*")]
    return [name for name in names if name[len(PREFIX) :].split("-")[0] in pids]


def test_exact_sums_and_gathers_then_a_dead_rank_raises_and_leaves_no_segment(reaped):
    processes, results = _start_pair(_member)
    try:
        got = {}
        for rank, (kind, payload) in _first_reports(results).items():
            assert kind == "done", payload
            assert payload[0] == "ShmComm"
            got[rank] = {name: torch.from_numpy(x) for name, x in payload[1].items()}
        assert not _our_segments(processes), "the name is removed once both ranks mapped it"
        _kill_and_expect_named(processes, results, 1)
    finally:
        join_or_kill(processes, timeout_s=5)
    assert not _our_segments(processes)
    a, b = _inputs(0), _inputs(1)
    for name in a:
        expected = (a[name] + b[name]).float()
        assert torch.equal(got[0][name], got[1][name]), "every rank holds the same bits"
        torch.testing.assert_close(got[0][name], expected, rtol=0, atol=0)
    assert torch.equal(got[0]["decode_op"], got[0]["decode"])
    for name in ("after_broadcasts", "after_broadcasts_2"):  # the slots were not mixed up
        assert torch.equal(got[0][name], got[0]["decode"])
        assert torch.equal(got[1][name], got[0]["decode"])
    assert torch.equal(got[0]["gather"], torch.tensor([[0.0] * 5 + [1.0] * 5] * 3))
    for name, rows in (
        ("columns", [a["decode"], b["decode"]]),
        ("columns_chunked", [_wide(0), _wide(1)]),
    ):
        side_by_side = torch.cat(rows, dim=-1)
        expected = side_by_side[:, _picked(rows[0].shape[1])]
        assert torch.equal(got[0][name], expected) and torch.equal(got[1][name], expected), name
    parts = [x["chunked"].view(2, -1) for x in (a, b)]
    assert torch.equal(got[1]["gather_chunked"], torch.cat(parts, dim=-1))


def _receiver(rank: int, port: int, results: mp.Queue) -> None:
    """Rank 0 sends one message and waits to be killed; rank 1 takes it, then waits (sleeping,
    as an idle rank does) for a second one that never comes: it must raise, naming rank 0."""
    try:
        comm = _join_group(rank, port)
        if rank == 0:
            comm.broadcast_send(b"hello")
            results.put(("sent", rank, None))
            signal.pause()  # killed by the test
        results.put(("received", rank, comm.broadcast_recv()))
        comm.broadcast_recv()
        results.put(("received", rank, None))
    except Exception:
        results.put(("error", rank, traceback.format_exc()))


def test_a_rank_waiting_for_a_broadcast_from_a_dead_root_raises(reaped):
    processes, results = _start_pair(_receiver)
    try:
        reports = _first_reports(results)
        assert reports == {0: ("sent", None), 1: ("received", b"hello")}
        time.sleep(0.2)  # rank 1 is past its spin, asleep between polls
        _kill_and_expect_named(processes, results, 0)
    finally:
        join_or_kill(processes, timeout_s=5)
    assert not _our_segments(processes)
