"""The inference engine: paged KV cache, prefix caching, continuous batching, sampling.

Data flow: LLM (frontend: text <-> token ids, stop strings, outputs) -> EngineCore (owner of
scheduling state: Scheduler + KVCacheManager) -> ModelRunner (weights, KV cache tensors,
forward pass, sampler) -> kernels/. Token ids are the ground truth everywhere; only the
frontend knows text. This package never imports `rollout`.
"""
from engine.errors import EngineDeadError, EngineStateError, InvalidRequestError, UnsupportedModelError
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "EngineDeadError", "EngineStateError", "InvalidRequestError", "UnsupportedModelError"]
