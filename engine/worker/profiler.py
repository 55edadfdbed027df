"""torch.profiler traces of the engine core, with the phases of a step labelled.

    LLM(profiler_dir="traces").start_profile() ... .stop_profile()  -> ["traces/rollout-dp0-....pt.trace.json"]
    (AsyncLLM: the same, awaited; HTTP: POST /start_profile, /stop_profile; `rollout serve --profiler-dir`)

A trace covers the engine-core process (where the scheduler, the worker and the model run) from
start to stop, CPU ops (and CUDA kernels on a GPU), with each step's phases as labelled ranges:
schedule, prepare_inputs, forward, compute_logits, sample, outputs (and pool, for encode requests). Files are Chrome traces
named *.pt.trace.json: chrome://tracing and Perfetto open them, and TensorBoard's profiler plugin
reads the folder. One file per engine-core replica (dp<rank>).

Profiling off costs nothing measurable: `phase(name)` is one global check that returns a shared
no-op context unless a trace is recording.
"""
import contextlib
import os
import time

import torch

from engine.errors import EngineStateError

_NOOP = contextlib.nullcontext()
_recording = False  # one profiler per process: torch's is process-wide


def phase(name: str):
    """A labelled range in the trace while one records, else a no-op."""
    return torch.profiler.record_function(name) if _recording else _NOOP


class StepProfiler:
    """The engine core's profiler: off unless the engine was given a folder for traces."""

    def __init__(self, folder: str | None, rank: int, device: str, all_threads: bool = False):
        self.folder, self.rank, self.device = folder, rank, device
        self.all_threads = all_threads  # the steps run in a thread of their own (async scheduling)
        self._prof: torch.profiler.profile | None = None
        self._started = 0.0

    def start(self) -> bool:
        global _recording
        if self.folder is None:
            raise EngineStateError("profiling is off: start the engine with profiler_dir "
                                   "(`rollout serve --profiler-dir DIR`)")
        if self._prof is not None:
            raise EngineStateError("a profile is already recording: stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.folder, exist_ok=True)
        # torch records the starting thread only unless told otherwise
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True) if self.all_threads else None
        self._prof = torch.profiler.profile(activities=activities, experimental_config=config)
        self._prof.start()
        self._started = time.time()
        _recording = True
        return True

    def stop(self) -> list[str]:
        """Stop and write the trace; returns its path (a list: replicas' paths are joined)."""
        global _recording
        if self._prof is None:
            raise EngineStateError("no profile is recording: start_profile() first")
        prof, self._prof = self._prof, None
        _recording = False
        prof.stop()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self._started))
        path = os.path.join(os.path.abspath(self.folder), f"rollout-dp{self.rank}-{stamp}-{os.getpid()}.pt.trace.json")
        prof.export_chrome_trace(path)
        return [path]
