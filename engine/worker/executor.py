"""Executor: how the engine core reaches its workers. The core hands every step's
SchedulerOutput to `execute_model` and gets one ModelRunnerOutput back; everything else goes
through `collective_rpc` (one result per worker).

    InprocExecutor   the worker lives in the engine-core process (the only executor today)

Data parallelism replicates the whole engine core (scheduler, KV cache, executor), so it needs
no other executor; tensor parallelism would add one whose workers are processes that all
receive the same SchedulerOutput (it is a msgspec Struct for that reason).
"""
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import worker_class


class Executor(Protocol):
    def initialize_kv_cache(self) -> int:
        """Allocate every worker's KV cache; returns the number of blocks they all hold."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the first worker's output is the step's result."""

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        """Call a public worker method (or worker-extension method) on every worker."""


class InprocExecutor:
    def __init__(self, config: EngineConfig):
        self.workers = [worker_class(config.worker_extension_cls)(config, rank=0)]

    def initialize_kv_cache(self) -> int:
        return min(w.initialize_kv_cache() for w in self.workers)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        outputs = [w.execute_model(scheduler_output) for w in self.workers]
        return outputs[0]

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        if not isinstance(method, str) or method.startswith("_"):
            raise ValueError(f"collective_rpc: {method!r} is not a public worker method")
        results = []
        for w in self.workers:
            fn = getattr(w, method, None)
            if not callable(fn):
                raise ValueError(f"collective_rpc: the worker has no method {method!r}")
            results.append(fn(*(args or ()), **(kwargs or {})))
        return results
