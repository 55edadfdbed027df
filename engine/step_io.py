"""The two payloads of one engine step, at the scheduler <-> worker boundary:

    Scheduler.schedule() -> SchedulerOutput -> Executor.execute_model (every worker)
        -> ModelRunnerOutput -> Scheduler.update_from_output() -> EngineCoreOutputs

A SchedulerOutput carries everything a worker needs, so a worker never reads scheduling state
(no Request objects, no KVCacheManager): it may live in another process. Workers keep a small
state per request (sampling params, the seeded generator, prompt-logprob progress), created by
`new_requests` and dropped by `finished_req_ids`; the token ids and block tables of a step
travel in `scheduled`. All are msgspec Structs, so they can cross a process boundary as is.
"""

import msgspec

from engine.protocol import MMFeature, SamplingMask
from engine.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers have not seen, or whose sampling params changed (a streaming-input
    chunk with new params): workers (re)load its params and, when seeded, a fresh generator."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int] | None = None  # only with prompt_logprobs: the targets
    lora_id: int = 0  # its LoRA adapter (0: none)
    mm_features: list[MMFeature] | None = None  # its prompt's images


# A token the step before this one samples (async scheduling): the worker takes it from its own
# last output. Only ever the single token of a decode.
PLACEHOLDER_TOKEN = -1


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's share of a step: compute `token_ids` at positions start, start + 1, ...
    writing their K/V into the slots that `block_ids` (the request's whole block table) maps."""

    request_id: str
    start: int  # the request's tokens already in the KV cache
    token_ids: list[int]
    block_ids: list[int]
    sample: bool = False  # the step reaches the request's last token: sample the next one
    banned_token_ids: list[int] | None = None  # stop tokens masked out before min_tokens


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    scheduled: list[ScheduledRequest] = []  # in scheduling order: running requests first
    new_requests: list[NewRequestData] = []
    finished_req_ids: list[str] = []  # finished or aborted since the last step: workers forget them
    num_preempted: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a step computed, by request id. logprobs / top_logprobs only for requests that
    asked; prompt_logprobs: (logprob of each prompt token this chunk predicts, top-k per token)."""

    sampled: dict[str, int] = {}
    logprobs: dict[str, float] = {}
    top_logprobs: dict[str, list[tuple[int, float]]] = {}
    prompt_logprobs: dict[str, tuple[list[float], list[list[tuple[int, float]]] | None]] = {}
    pooled: dict[str, list[float]] = {}  # encode requests whose prompt is done: the pooled vector
    sampling_masks: dict[str, SamplingMask] = {}  # the sampled token's kept set (return_sampling_mask)
    # return_routed_experts: (first position, int16 bytes (n, num_layers, top_k)) of the rows that became
    # available since the request's previous sampling step (engine/routed_experts.py)
    routed_experts: dict[str, tuple[int, bytes]] = {}
