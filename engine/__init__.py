"""The inference engine: paged KV cache, prefix caching, continuous batching, sampling.

Data flow: LLM / AsyncLLM (frontend: text <-> token ids, stop strings, outputs) -> EngineCore
(owner of scheduling, pause and sleep state: Scheduler + KVCacheManager) -> Executor ->
Worker -> ModelRunner (weights, KV cache tensors, forward pass, sampler) -> kernels/. The
scheduler hands the workers a SchedulerOutput and gets a ModelRunnerOutput back
(engine/step_io.py). Token ids are the ground truth everywhere; only the frontend knows
text. This package never imports `rollout`.
"""
from engine.core.streaming import StreamingInput
from engine.errors import (EngineDeadError, EngineStartError, EngineStateError, InvalidRequestError,
                           UnsupportedModelError)
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.llm import LLM
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.process.replicas import Route
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "StreamingInput", "Route", "EngineDeadError", "EngineStartError", "EngineStateError", "InvalidRequestError",
           "UnsupportedModelError"]
