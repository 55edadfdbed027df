"""Executor: how the engine core reaches its workers. The core hands every step's
SchedulerOutput to `execute_model` and gets one ModelRunnerOutput back; everything else goes
through `collective_rpc` (one result per worker rank).

    InprocExecutor      one worker, in the engine-core process (tensor_parallel_size 1)
    MultiprocExecutor   tensor_parallel_size ranks: rank 0 in the engine-core process, the others
                        in processes of their own (engine/worker/multiproc_executor.py)

Data parallelism replicates the whole engine core (scheduler, KV cache, executor); tensor
parallelism splits one replica's model between the ranks of its executor, which all receive the
same SchedulerOutput (a msgspec Struct for that reason).
"""
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import worker_class


class Executor(Protocol):
    def initialize_kv_cache(self) -> int:
        """Allocate every rank's KV cache; returns the number of blocks they all hold."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output is the step's result."""

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        """Call a public worker method (or worker-extension method) on every rank, results in rank order."""

    def shutdown(self) -> None:
        """Stop the ranks that run in processes of their own."""


class InprocExecutor:
    def __init__(self, config: EngineConfig):
        self.worker = worker_class(config.worker_extension_cls)(config, rank=0)

    def initialize_kv_cache(self) -> int:
        return self.worker.initialize_kv_cache()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        return [worker_method(self.worker, method)(*(args or ()), **(kwargs or {}))]

    def shutdown(self) -> None:
        pass


def worker_method(worker, method: str):
    """The public worker method `method` (ValueError otherwise: collective_rpc reaches nothing else)."""
    if not isinstance(method, str) or method.startswith("_"):
        raise ValueError(f"collective_rpc: {method!r} is not a public worker method")
    fn = getattr(worker, method, None)
    if not callable(fn):
        raise ValueError(f"collective_rpc: the worker has no method {method!r}")
    return fn
