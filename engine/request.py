"""Request: the engine core's state of one sequence (token ids only, no text)."""
import enum
from typing import Optional

import torch

from engine.protocol import EngineCoreRequest, FinishReason
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    """One sequence. Its tokens are prompt + output; the scheduler moves num_computed_tokens
    towards num_tokens, and a token is sampled whenever the two meet."""

    def __init__(self, req: EngineCoreRequest):
        self.request_id = req.request_id
        self.params: SamplingParams = req.sampling_params
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.all_token_ids = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first scheduled
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: Optional[int] = None
        p = self.params
        self.stop_ids = set(p.stop_token_ids or ())
        if req.eos_token_id is not None and not p.ignore_eos:
            self.stop_ids.add(req.eos_token_id)
        self.max_tokens = p.max_tokens
        self.generator: Optional[torch.Generator] = None
        if p.seed is not None:
            self.generator = torch.Generator().manual_seed(p.seed)
        self.block_hashes: list[int] = []  # hash chain of this request's full blocks, grown lazily
        # prompt logprobs gathered over prefill chunks (sent with the first output token)
        self.prompt_logprobs: Optional[list[Optional[float]]] = [None] if p.prompt_logprobs is not None else None
        self.prompt_top_logprobs: Optional[list] = [None] if p.prompt_logprobs else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int, max_model_len: int) -> bool:
        """Add a sampled token; returns True (and sets finish_reason) if the request is done."""
        self.all_token_ids.append(token_id)
        n = self.num_output_tokens
        if n >= self.params.min_tokens and token_id in self.stop_ids:
            self.finish_reason, self.stop_reason = FinishReason.STOP, token_id
        elif (self.max_tokens is not None and n >= self.max_tokens) or self.num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
