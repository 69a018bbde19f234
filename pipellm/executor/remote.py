"""What the executors with stages in other processes (mp, ray) share: pending results and
an orderly, idempotent shutdown."""

from __future__ import annotations

import weakref

from pipellm.executor.base import Executor, WorkerDiedError
from pipellm.executor.pending import PendingOutputs


class RemoteStagesExecutor(Executor):
    """An executor whose stages run elsewhere (processes, Ray actors): their results resolve
    `_pending` in submission order, and `_finalizer` reaps the stages even if nobody calls
    shutdown()."""

    _pending: PendingOutputs
    _closed: bool
    _finalizer: weakref.finalize

    def _raise_if_dead(self) -> None:
        if self._pending.dead:
            raise WorkerDiedError(self._pending.dead)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending.fail("the executor was shut down", log=False)
        self._finalizer()
