"""Executor: how the engine core reaches its workers. The core hands every step's
SchedulerOutput to `execute_model` and gets one ModelRunnerOutput back; everything else goes
through `collective_rpc` (one result per worker rank).

    InprocExecutor      one worker, in the engine-core process (tensor_parallel_size 1)
    MultiprocExecutor   tensor_parallel_size ranks: rank 0 in the engine-core process, the others
                        in processes of their own (engine/worker/multiproc_executor.py)
    StepThreadExecutor  async scheduling: one of those in a thread of its own, so that the core
                        schedules step N+1 while step N runs (`submit`)

Data parallelism replicates the whole engine core (scheduler, KV cache, executor); tensor
parallelism splits one replica's model between the ranks of its executor, which all receive the
same SchedulerOutput (a msgspec Struct for that reason).
"""
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

import torch

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

    def launch_model(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start a step; the function returned reads its samples back (see ModelRunner.launch)."""
        return self.worker.launch_model(scheduler_output)

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


# Marks a thread whose calls reach a StepThreadExecutor where they are made instead of queueing
# behind the steps: a Deferred's helper thread (a weight group that forms may wait for seconds).
beside_steps = threading.local()


class StepThreadExecutor:
    """Another executor, built in one thread of its own where every call to it runs: `submit`
    starts a step and returns at once (async scheduling; it replaces execute_model), every other
    call waits for the steps before it. Every call, not only the steps: on a CPU each thread that
    runs a parallel torch op keeps an OpenMP team of its own, and once the process holds more
    OpenMP threads than cores libgomp's idle workers stop spinning, so each of the ~100 parallel
    regions of a step waits for a futex wake. With the load, the steps and the control calls in
    this one thread, the core's thread never starts a team."""

    def __init__(self, make: Callable[[], Executor], num_threads: int, device: str, cpus: set[int] | None = None):
        """`cpus`: the cores the thread pins itself to once `make` returned (tensor parallelism:
        the other ranks, started by `make`, must inherit all of them to pin themselves to theirs)."""
        self._pool = ThreadPoolExecutor(1, "engine-step", initializer=_step_thread_setup,
                                        initargs=(num_threads, device))
        self._thread = self._pool.submit(threading.current_thread).result()
        try:
            self.inner = self._pool.submit(make).result()
            if cpus is not None:
                self._pool.submit(os.sched_setaffinity, 0, cpus).result()
        except BaseException:  # (a model that fails to load leaves no thread behind)
            self._pool.shutdown()
            raise

    @property
    def worker(self):
        return self.inner.worker

    @property
    def on_death(self) -> Callable[[str], None] | None:
        return getattr(self.inner, "on_death", None)

    @on_death.setter
    def on_death(self, fn: Callable[[str], None] | None) -> None:  # (the engine-core process sets it)
        self.inner.on_death = fn

    def _call(self, fn: Callable, *args) -> Any:
        if threading.current_thread() is self._thread or getattr(beside_steps, "active", False):
            return fn(*args)
        return self._pool.submit(fn, *args).result()

    def submit(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput] | LaunchedStep":
        """Queue a step behind the ones before it. One worker in this process: the step thread only
        launches it (ModelRunner.launch) and goes on to the next, and `result()` reads its samples
        back in the caller's thread; with ranks in processes of their own, the whole step."""
        launch = getattr(self.inner, "launch_model", None)
        if launch is None:
            return self._pool.submit(self.inner.execute_model, scheduler_output)
        return LaunchedStep(self._pool.submit(launch, scheduler_output))

    def initialize_kv_cache(self) -> int:
        return self._call(self.inner.initialize_kv_cache)

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        return self._call(self.inner.collective_rpc, method, args, kwargs)

    def shutdown(self) -> None:
        self._call(self.inner.shutdown)
        self._pool.shutdown()


class LaunchedStep:
    """A step that the step thread launched: result() waits for the launch, then for the step's
    samples (in the caller's thread), once."""

    def __init__(self, launched: "Future[Callable[[], ModelRunnerOutput]]"):
        self._launched = launched
        self._out: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._out is None:
            self._out = self._launched.result()()
        return self._out


def _step_thread_setup(num_threads: int, device: str) -> None:
    """The step thread runs as its creator would: torch's thread count and the current CUDA
    device are per thread."""
    torch.set_num_threads(num_threads)
    if torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))
