"""A worker extension for the AsyncLLM tests (collective_rpc, fault injection).

Loaded by the engine-core process (a fresh interpreter) through
`AsyncLLM(worker_extension_cls="tests.engine.worker_ext.TestWorkerExtension")`; its methods
see `self` as the worker (rank, model, model_runner, execute_model).
"""
import os
import time


class TestWorkerExtension:
    __test__ = False  # a worker mixin, not a pytest test class

    def echo_rank(self, x):
        return [self.rank, x]

    def param_sum(self, name: str) -> float:
        return float(self.model.hf_view(name).float().sum())

    def param_tensor(self, name: str):
        return self.model.hf_view(name).detach().clone()  # tensors travel as raw frames

    def boom(self):
        raise RuntimeError("boom from worker")

    def sleep_for(self, seconds: float) -> float:
        time.sleep(seconds)  # blocks the engine-core busy loop meanwhile
        return seconds

    def unserializable(self):
        return object()  # msgpack cannot carry it back

    def _secret(self):
        return "must not be reachable"

    def break_next_step(self) -> bool:
        """Make the next engine step raise."""

        def broken(*args, **kwargs):
            raise RuntimeError("injected step failure")

        self.execute_model = broken
        return True

    def record_steps(self) -> bool:
        """From now on, remember how many tokens each step computes for each request."""
        execute = type(self).execute_model.__get__(self)
        self.recorded_steps = []

        def recording(scheduler_output):
            self.recorded_steps.append({r.request_id: len(r.token_ids) for r in scheduler_output.scheduled})
            return execute(scheduler_output)

        self.execute_model = recording
        return True

    def take_recorded_steps(self) -> list:
        steps, self.recorded_steps = self.recorded_steps, []
        return steps

    def exit_now(self, code: int = 3):
        os._exit(code)
