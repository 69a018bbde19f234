"""A Ray stage's own loop: micro-batches run in their numbered order, whatever order Ray's
threads hand them over in, and a failure fails every later one."""

from __future__ import annotations

import threading
import time

import pytest

from pipellm.executor.step_loop import StepLoop


def submit_in_threads(loop: StepLoop, numbers: list[int]) -> dict[int, object]:
    results: dict[int, object] = {}

    def call(number: int) -> None:
        try:
            results[number] = loop.submit(number, f"mb{number}")
        except Exception as error:
            results[number] = error

    threads = []
    for number in numbers:  # handed over in this order, a moment apart
        thread = threading.Thread(target=call, args=(number,))
        thread.start()
        threads.append(thread)
        time.sleep(0.02)
    for thread in threads:
        thread.join(timeout=10)
    return results


def test_micro_batches_run_in_their_numbered_order_on_one_thread():
    ran: list[tuple[str, str]] = []
    started = []

    def run(item: str, following: str | None) -> str:
        ran.append((item, threading.current_thread().name))
        time.sleep(0.05)  # the next items arrive meanwhile
        return item.upper()

    loop = StepLoop(run, on_start=lambda: started.append(threading.current_thread().name))
    results = submit_in_threads(loop, [2, 0, 3, 1])
    assert [item for item, _ in ran] == ["mb0", "mb1", "mb2", "mb3"]
    assert {name for _, name in ran} == {"pipellm-stage-loop"} and started == ["pipellm-stage-loop"]
    assert results == {n: f"MB{n}" for n in range(4)}
    with pytest.raises(ValueError, match="number 1 was submitted already"):
        loop.submit(1, "again")
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(4, "late")


def test_the_next_micro_batch_is_passed_along_once_it_has_arrived():
    seen: list[tuple[str, str | None]] = []
    first_running = threading.Event()

    def run(item: str, following: str | None) -> str:
        seen.append((item, following))
        first_running.set()
        time.sleep(0.1)
        return item

    loop = StepLoop(run)
    results = submit_in_threads(loop, [0, 1, 2])  # 1 and 2 arrive while 0 runs
    assert first_running.is_set() and results == {0: "mb0", 1: "mb1", 2: "mb2"}
    assert [item for item, _ in seen] == ["mb0", "mb1", "mb2"]
    # The next one or nothing, never another; 2 arrived while 1 waited behind 0's 0.1 s.
    assert seen[0][1] in (None, "mb1") and seen[1][1] == "mb2" and seen[2][1] is None
    loop.close()


def test_a_failed_micro_batch_fails_every_later_one_with_its_error():
    def run(item: str, following: str | None) -> str:
        if item == "mb1":
            raise RuntimeError("peer connection reset")
        return item

    loop = StepLoop(run)
    results = submit_in_threads(loop, [0, 1, 2])
    assert results[0] == "mb0"
    assert isinstance(results[1], RuntimeError) and isinstance(results[2], RuntimeError)
    assert str(results[2]) == "peer connection reset"
    loop.close()


def test_close_fails_the_micro_batches_still_waiting_for_an_earlier_one():
    loop = StepLoop(lambda item, following: item.upper())
    results: dict[int, object] = {}

    def wait_for_five() -> None:
        try:
            results[5] = loop.submit(5, "mb5")  # 0..4 never come
        except RuntimeError as error:
            results[5] = error

    thread = threading.Thread(target=wait_for_five)
    thread.start()
    time.sleep(0.05)
    loop.close()
    thread.join(timeout=5)
    assert isinstance(results[5], RuntimeError) and "closed" in str(results[5])
