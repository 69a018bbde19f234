"""Builds the executor that `distributed_executor_backend` names; backends import lazily, so
choosing one never loads another's dependencies (Ray, torch.distributed)."""

from __future__ import annotations

from pipellm.config import EngineConfig
from pipellm.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    backend = config.distributed_executor_backend
    if backend == "uni":
        from pipellm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    if backend == "mp":
        from pipellm.executor.tp_driver import TensorParallelDriverExecutor, driver_applies

        if driver_applies(config):  # T > 1, one stage: rank 0 in this process
            return TensorParallelDriverExecutor(config)
        from pipellm.executor.mp import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from pipellm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if backend == "sim":
        from pipellm.executor.sim import SimExecutor

        return SimExecutor(config)
    raise NotImplementedError(f"distributed_executor_backend={backend!r} is not available yet")
