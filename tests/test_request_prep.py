"""The request prep pool: work off the event loop, a bounded queue (503 past it), a deadline
that refuses the request while the job's slot stays taken until the job really ends."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pipellm.entrypoints.openai_protocol import OpenAIError
from pipellm.entrypoints.request_prep import RequestPrep


def test_jobs_run_on_other_threads_and_raise_their_errors():
    async def main() -> None:
        prep = RequestPrep(num_threads=1, max_queued=1)
        assert await prep.run(threading.get_ident) != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await prep.run(lambda: 1 / 0)
        assert prep.num_jobs == 0
        prep.close()

    asyncio.run(main())


def test_a_full_queue_is_a_503_and_a_timed_out_job_keeps_its_slot_until_it_ends():
    async def main() -> None:
        prep = RequestPrep(num_threads=1, max_queued=1)
        release = threading.Event()
        with pytest.raises(TimeoutError):
            await prep.run(release.wait, timeout_s=0.05)
        queued = asyncio.ensure_future(prep.run(lambda: "queued"))
        await asyncio.sleep(0)
        assert prep.num_jobs == 2  # the timed-out job still runs: its slot is not free
        with pytest.raises(OpenAIError) as refused:
            await prep.run(lambda: "refused")
        assert refused.value.status_code == 503 and refused.value.code == "server_busy"
        release.set()
        assert await queued == "queued"
        assert prep.num_jobs == 0
        prep.close()

    asyncio.run(main())
