"""The shared-memory all-reduce / all-gather between two processes: exact sums (every rank
the same bits), chunks larger than a slot, other dtypes, and no segment left when a rank dies."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback

import pytest
import torch

from pipellm.executor.mp import join_or_kill
from pipellm.parallel.shm_comm import PREFIX, SHM_DIR, SLOT_BYTES, shm_comm_available
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


def _member(rank: int, port: int, results: mp.Queue) -> None:
    """Runs the collectives, reports them; then rank 1 waits to be killed and rank 0
    all-reduces once more, which must raise rather than hang."""
    import torch.distributed as dist

    from pipellm.parallel.tp_group import make_tensor_parallel_comm

    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        comm = make_tensor_parallel_comm(1, 2, 0)
        out = {name: comm.all_reduce_(x.clone()) for name, x in _inputs(rank).items()}
        # The same collective as the op C++ callers use (kernels/decode_layers.cpp).
        out["decode_op"] = _inputs(rank)["decode"]
        torch.ops.pipellm_shm.all_reduce_(out["decode_op"], comm.handle)
        out["gather"] = comm.all_gather(torch.full((3, 5), float(rank)))
        out["gather_chunked"] = comm.all_gather(_inputs(rank)["chunked"].view(2, -1))
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
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_member, args=(r, port, results), daemon=True) for r in range(2)
    ]
    for process in processes:
        process.start()
    try:
        got = {}
        for _ in range(2):
            kind, rank, payload = results.get(timeout=TIMEOUT_S)
            assert kind == "done", payload
            assert payload[0] == "ShmComm"
            got[rank] = {name: torch.from_numpy(x) for name, x in payload[1].items()}
        assert not _our_segments(processes), "the name is removed once both ranks mapped it"
        os.kill(processes[1].pid, signal.SIGKILL)
        kind, rank, payload = results.get(timeout=TIMEOUT_S)
        assert (kind, rank) == ("error", 0)
        assert f"rank 1 (pid {processes[1].pid}) is gone" in payload
    finally:
        join_or_kill(processes, timeout_s=5)
    assert not _our_segments(processes)
    a, b = _inputs(0), _inputs(1)
    for name in a:
        expected = (a[name] + b[name]).float()
        assert torch.equal(got[0][name], got[1][name]), "every rank holds the same bits"
        torch.testing.assert_close(got[0][name], expected, rtol=0, atol=0)
    assert torch.equal(got[0]["decode_op"], got[0]["decode"])
    assert torch.equal(got[0]["gather"], torch.tensor([[0.0] * 5 + [1.0] * 5] * 3))
    parts = [x["chunked"].view(2, -1) for x in (a, b)]
    assert torch.equal(got[1]["gather_chunked"], torch.cat(parts, dim=-1))
