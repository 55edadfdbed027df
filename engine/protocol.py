"""Payloads between the frontend and the engine core: msgspec Structs, wire-ready (msgpack).

The frontend owns text; the core sees token ids only.
"""
import enum
from typing import Optional

import msgspec

from engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token, or a stop string
    LENGTH = 1  # max_tokens or the context is full
    ABORT = 2  # aborted by the caller, or a stop string found by the frontend

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None
    arrival_time: float = 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: at most one new token (more after a resume)."""

    request_id: str
    new_token_ids: list[int]
    weight_version: int = 0
    new_logprobs: Optional[list[float]] = None
    new_top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_logprobs: Optional[list[Optional[float]]] = None
    prompt_top_logprobs: Optional[list[Optional[list[tuple[int, float]]]]] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[int] = None  # the stop token id, if one ended the request
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
