"""Request: the scheduler's state of one sequence (token ids only, no text). Workers never
see it: what they need travels in the SchedulerOutput (engine/step_io.py)."""
import enum
import time

from engine.core.streaming import InputStream
from engine.protocol import EngineCoreRequest, FinishReason, StreamInput
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    IDLE = 3  # a streaming-input request between chunks: holds its KV blocks, waits for input
    HELD = 4  # arrived while generation is paused: admitted on resume
    FINISHED = 5
    AWAITING_WEIGHTS = 6  # its min_weight_version is above the live version: admitted when a push reaches it


class Request:
    """One sequence. Its tokens are prompt + output; the scheduler moves num_computed_tokens
    towards num_tokens, and a token is sampled whenever the two meet."""

    def __init__(self, req: EngineCoreRequest):
        self.request_id = req.request_id
        self.params: SamplingParams = req.sampling_params
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.all_token_ids = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens scheduled into the KV cache (counted when scheduled)
        # tokens sampled by steps in flight, not appended yet (async scheduling: the next step already
        # computes a row whose input is the first of them, engine/core/scheduler.py)
        self.num_placeholders = 0
        self.num_void_samples = 0  # samples in flight of a chunk that ended: dropped when they arrive
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first scheduled
        self.arrival_time = time.monotonic()  # in the core; scheduled_time: when first scheduled (0.0: not yet)
        self.scheduled_time = 0.0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.eos_token_id = req.eos_token_id
        self.lora_id = req.lora_id
        # seeds the block hash chain: a LoRA adapter changes the KV of every token, and a cache
        # salt keeps a tenant's (or a weight version's) prefixes to itself
        self.hash_seed = ("salt", req.lora_id, req.cache_salt) if req.lora_id or req.cache_salt else None
        self.mm_features = req.mm_features  # its prompt's images (a vision-language model)
        self._set_params(self.params)
        self.stream: InputStream | None = InputStream() if req.streaming else None
        self.chunk_start = self.num_prompt_tokens  # where the current chunk's output begins
        self.block_hashes: list[int] = []  # hash chain of this request's full blocks, grown lazily
        # prompt logprobs gathered over prefill chunks (sent with the first output token)
        self.prompt_logprobs: list[float | None] | None = [None] if self.params.prompt_logprobs is not None else None
        self.prompt_top_logprobs: list | None = [None] if self.params.prompt_logprobs else None
        # the weight version of its first generated token; recorded lazily, at the first change of
        # the live version after that token (engine/core/staleness.py), None until then
        self.oldest_version: int | None = None

    def restart(self) -> None:
        """Forget every generated token (stale_action "restart"): it starts again from its prompt,
        holding no blocks (the scheduler freed them)."""
        del self.all_token_ids[self.num_prompt_tokens:]
        self.num_computed_tokens = self.num_placeholders = self.num_void_samples = 0
        self.block_hashes.clear()  # (a hash may cover generated tokens; the prompt's are recomputed lazily)
        self.finish_reason = self.stop_reason = None
        self.oldest_version = None
        if self.prompt_logprobs is not None:  # the new weights' prompt logprobs come with its new first token
            self.prompt_logprobs = [None]
            self.prompt_top_logprobs = [None] if self.params.prompt_logprobs else None

    def _set_params(self, p: SamplingParams) -> None:
        self.params = p
        self.stop_ids = set(p.stop_token_ids or ())
        if self.eos_token_id is not None and not p.ignore_eos:
            self.stop_ids.add(self.eos_token_id)

    def apply_input(self, chunk: StreamInput) -> None:
        """Start the next chunk: its tokens follow everything so far (outputs included)."""
        self.all_token_ids.extend(chunk.prompt_token_ids)
        if chunk.sampling_params is not None:
            self._set_params(chunk.sampling_params)
        self.chunk_start = self.num_tokens
        self.finish_reason = self.stop_reason = None

    @property
    def num_chunk_output_tokens(self) -> int:
        return self.num_tokens - self.chunk_start

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def banned_token_ids(self) -> list[int] | None:
        """The stop tokens the next sample must avoid (min_tokens not reached yet)."""
        if self.num_chunk_output_tokens + self.num_placeholders < self.params.min_tokens and self.stop_ids:
            return sorted(self.stop_ids)
        return None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int, max_model_len: int) -> bool:
        """Add a sampled token; returns True (and sets finish_reason) if the request is done."""
        self.all_token_ids.append(token_id)
        n = self.num_chunk_output_tokens
        max_tokens = self.params.max_tokens
        if n >= self.params.min_tokens and token_id in self.stop_ids:
            self.finish_reason, self.stop_reason = FinishReason.STOP, token_id
        elif (max_tokens is not None and n >= max_tokens) or self.num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
