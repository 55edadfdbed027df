"""What the engine hands back to its callers (mirrors vLLM's RequestOutput / CompletionOutput)."""
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.protocol import SamplingMask


@dataclass
class CompletionOutput:
    """One generated sequence.

    logprobs[i]: logprob of token_ids[i] (see SamplingParams.logprobs_mode: by default the
    log-softmax of the final logits after temperature and filters; "raw" for the model's own).
    top_logprobs[i]: {token_id: logprob} of the top-k candidates at step i (when logprobs=k > 0).
    sampling_masks[i]: the set token_ids[i] was drawn from (SamplingParams.return_sampling_mask;
    engine.protocol.SamplingMask).
    weight_versions[i]: the weight version of the model that produced token_ids[i].
    lora_versions[i]: the version of the request's LoRA adapter that produced it (empty without one).
    routed_experts (SamplingParams.return_routed_experts): int16 array (num_tokens, num_layers, top_k),
    row p = the experts each layer routed the token at position p of prompt + token_ids to (-1 in
    dense layers); num_tokens = len(prompt) + len(token_ids) - 1, as the last token was never run
    through the model. Read-only. With output_kind DELTA: the rows new since the previous output
    (the first one starts with the prompt's); a streaming-input request's rows follow its whole
    context (every chunk's input, then its output). engine/routed_experts.py.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    sampling_masks: list[SamplingMask] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "stale" | None while running
    stop_reason: object | None = None  # the stop string or stop token id that ended it
    weight_versions: list[int] = field(default_factory=list)
    lora_versions: list[int] = field(default_factory=list)
    routed_experts: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[float | None] | None = None  # [0] is None (no prefix)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    core_timestamp: float = 0.0  # time.monotonic() when the engine core produced the newest token
    first_token_time: float | None = None  # time.monotonic() when the first token reached the frontend
    pooled: list[float] | None = None  # an encode request's vector (SamplingParams.pooling)


@dataclass
class PoolingOutput:
    """The result of encoding one prompt (LLM.encode / AsyncLLM.encode): the final hidden state
    pooled over the prompt (last token or mean), or a classifier's label logits."""

    request_id: str
    prompt_token_ids: list[int]
    data: torch.Tensor  # (hidden,) or (num_labels,) float32
    finished: bool = True

    @classmethod
    def of(cls, out: RequestOutput, normalize: bool = False) -> "PoolingOutput":
        data = torch.tensor(out.pooled, dtype=torch.float32)
        if normalize:
            data = torch.nn.functional.normalize(data, dim=0)
        return cls(out.request_id, out.prompt_token_ids, data)
