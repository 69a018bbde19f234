"""A stage's own loop inside its Ray actor: its micro-batches run one after another on one
thread, which takes the next one the moment the last is done.

Why not one Ray actor task per micro-batch, run by the actor's own thread? Between two such
tasks Ray hands the finished result to its I/O threads and the next task back to the actor's
thread; on a host whose cores are busy computing, each hand-over waits for a time slice, so a
stage sat idle with its next input already there, several times longer than the mp backend's
stage, which reads its next schedule from a pipe itself (docs/pipeline.md). Here Ray's threads
(the actor's `max_concurrency`) only hand a micro-batch in and wait for its result, so they
work while the loop computes, not between micro-batches.

Ray runs a threaded actor's calls in no guaranteed order (Ray's "Actor Task Execution Order"),
so every micro-batch carries its submission number and the loop runs them in that order: every
stage must, as its KV cache and its transfers to the next stage follow that order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class StepLoop(Generic[Item, Result]):
    """Runs `run(item, following)` for items 0, 1, 2, ... in that order on its own thread,
    whatever the order they arrive in; `following` is the next item when it has arrived
    already (else None), so the stage can receive its inputs ahead. `submit` waits for its
    item's result (or error). After a failure every later item fails with the same error: the
    stage's state is unknown from then on."""

    def __init__(
        self,
        run: Callable[[Item, Item | None], Result],
        on_start: Callable[[], None] | None = None,
    ):
        self._run, self._on_start = run, on_start
        self._waiting: dict[int, tuple[Item, Future[Result]]] = {}
        self._next = 0
        self._closed = False
        self._failure: BaseException | None = None
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="pipellm-stage-loop", daemon=True)
        self._thread.start()

    def submit(self, number: int, item: Item) -> Result:
        done: Future[Result] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the stage's loop was closed")
            if number < self._next or number in self._waiting:
                raise ValueError(f"micro-batch number {number} was submitted already")
            self._waiting[number] = (item, done)
            self._ready.notify()
        return done.result()

    def close(self) -> None:
        """Stops the loop after the item it is running; items still waiting fail."""
        with self._ready:
            self._closed = True
            waiting, self._waiting = self._waiting, {}
            self._ready.notify()
        for _, done in waiting.values():
            done.set_exception(RuntimeError("the stage's loop was closed"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()  # per-thread settings (torch's thread count) for this thread
            except BaseException as error:
                self._failure = error
        while True:
            with self._ready:
                while not self._closed and self._next not in self._waiting:
                    self._ready.wait()
                if self._closed:
                    return
                item, done = self._waiting.pop(self._next)
                self._next += 1
                following = self._waiting.get(self._next, (None, None))[0]
            if self._failure is not None:
                done.set_exception(self._failure)
                continue
            try:
                result = self._run(item, following)
            except BaseException as error:  # the caller re-raises it; later items fail too
                self._failure = error
                done.set_exception(error)
                continue
            done.set_result(result)
