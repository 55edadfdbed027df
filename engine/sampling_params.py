"""SamplingParams: what to generate and how, per request (vLLM's field names and defaults)."""
import enum
import math

import msgspec

from engine.errors import InvalidRequestError


# what msgpack carries between the frontend and the engine core
INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
MAX_N = 1024  # samples per request (a request fans out into n sequences)
STALE_ACTIONS = ("finish", "restart")  # what max_weight_staleness does to a request it catches
SAMPLING_MASK_MODES = (False, True, "threshold", "ids")
# ids of one token's kept set sent at most (return_sampling_mask "ids"): a larger set is sent as its
# size and threshold only (prime-rl bounds its replayed sets at 512 too)
MAX_SAMPLING_MASK_IDS = 512


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters of one request.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 switch those filters off.
    logprobs: None = no logprobs; k >= 0 = the sampled token's logprob plus the top k.
    logprobs_mode: "processed" (default) = log-softmax of the logits after temperature and the
    top-k / top-p / min-p filters, i.e. of the distribution the token was drawn from (greedy:
    the raw logits); "raw" = log-softmax of the model's raw logits.
    prompt_logprobs: None or k >= 0; the raw log-softmax of each prompt token given its prefix.
    temp_scaled_prompt_logprobs: the prompt logprobs of logits / temperature instead (SGLang's
    temp_scaled_logprobs; temperature 0: raw), what a recompute of sampled tokens compares against.
    return_sampling_mask: per generated token, the set of tokens the sampler could have drawn (what
    top-k / top-p / min-p kept; see engine.protocol.SamplingMask). False = none; True or "threshold"
    = its size, smallest logprob and mass; "ids" = also its token ids (when at most
    MAX_SAMPLING_MASK_IDS; needs a truncation or greedy: otherwise every set is the vocabulary).
    return_routed_experts: the experts a mixture-of-experts model routed every token to, per layer
    (routing replay in the trainer; CompletionOutput.routed_experts). The engine must have been
    started with enable_return_routed_experts.
    max_tokens: None = until the context is full.
    pooling: None = generate; "last" / "mean" = encode (LLM.encode): nothing is generated, the
    request returns its final hidden state at the last prompt token, or averaged over the prompt
    (a classifier model: its head's label logits of that vector).
    max_weight_staleness: None = no limit; k >= 0 = when the live weights' version moves (a push,
    set_weight_version) more than k versions past the version of the request's oldest generated
    token, it is handled by stale_action: "finish" ends it with its tokens so far (finish_reason
    "stale"), "restart" discards them and generates again from the prompt under the new weights
    (not with output_kind DELTA nor streaming input). Base-model versions only: a LoRA adapter's
    own version does not count. A request with no token yet is never stale.
    min_weight_version: None, or N >= 0 = the request waits (holding no KV) until the live weights'
    version reaches N, then runs (each data-parallel replica checks its own version).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: None | str | list[str] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "processed"
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    skip_special_tokens: bool = True
    pooling: str | None = None
    max_weight_staleness: int | None = None
    min_weight_version: int | None = None
    stale_action: str = "finish"
    temp_scaled_prompt_logprobs: bool = False
    return_sampling_mask: bool | str = False
    return_routed_experts: bool = False

    def __post_init__(self):
        """Every field is checked here (the engine API has no other validation): a wrong type or
        value is an InvalidRequestError naming the field, and whatever passes fits the wire."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check(_is_int(self.n, 1, MAX_N), "n", f"must be an int in [1, {MAX_N}], got {self.n!r}")
        for name in ("temperature", "top_p", "min_p"):  # floats on the wire: an int there would not round-trip
            v = getattr(self, name)
            if _is_num(v) and not isinstance(v, float):
                _check(abs(v) < 1e300, name, f"must be a finite number, got {v!r}")
                setattr(self, name, float(v))
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k, 0, INT64_MAX), "top_k", f"must be an int >= 0 (0 or -1 = off), got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed, INT64_MIN, UINT64_MAX), "seed",
               f"must be an int in [-2^63, 2^64), got {self.seed!r}")
        _check(self.max_tokens is None or _is_int(self.max_tokens, 1, INT64_MAX), "max_tokens",
               f"must be an int >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens, 0, INT64_MAX), "min_tokens", f"must be an int >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.stop is None or (isinstance(self.stop, list) and all(isinstance(x, str) and x for x in self.stop)),
               "stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        _check(self.stop_token_ids is None or (isinstance(self.stop_token_ids, list) and all(
            _is_int(t, 0, INT64_MAX) for t in self.stop_token_ids)), "stop_token_ids",
               f"must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or _is_int(v, 0, 20), name, f"must be None or 0..20, got {v!r}")
        _check(self.logprobs_mode in ("processed", "raw"), "logprobs_mode",
               f"must be 'processed' or 'raw', got {self.logprobs_mode!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "detokenize", "skip_special_tokens",
                     "temp_scaled_prompt_logprobs", "return_routed_experts"):
            _check(isinstance(getattr(self, name), bool), name, f"must be a bool, got {getattr(self, name)!r}")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            kinds = [k.name for k in RequestOutputKind]
            raise InvalidRequestError(f"SamplingParams.output_kind must be one of {kinds}, got {self.output_kind!r}",
                                      "output_kind") from None
        _check(self.n == 1 or self.temperature > 0, "n", "n > 1 needs temperature > 0 (greedy copies are identical)")
        _check(self.pooling in (None, "last", "mean"), "pooling",
               f"must be None, 'last' or 'mean', got {self.pooling!r}")
        _check(self.pooling is None or (self.n == 1 and self.logprobs is None and self.prompt_logprobs is None),
               "pooling", "an encode request (pooling) takes n=1 and no logprobs")
        self._check_sampling_mask()
        _check(not self.return_routed_experts or self.pooling is None, "return_routed_experts",
               "an encode request (pooling) routes no generated tokens: it is not supported there")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need detokenize=True", "stop")
        for name in ("max_weight_staleness", "min_weight_version"):
            v = getattr(self, name)
            _check(v is None or _is_int(v, 0, INT64_MAX), name, f"must be None or an int >= 0, got {v!r}")
        _check(self.stale_action in STALE_ACTIONS, "stale_action",
               f"must be 'finish' or 'restart', got {self.stale_action!r}")
        # a delta stream has handed the discarded tokens out already: nothing could take them back
        _check(self.stale_action == "finish" or self.output_kind != RequestOutputKind.DELTA, "stale_action",
               "'restart' discards the tokens generated so far, which a delta stream (stream: true) has already "
               "sent: use 'finish' with streaming, or do not stream")

    def _check_sampling_mask(self) -> None:
        mask = self.return_sampling_mask
        _check(isinstance(mask, (bool, str)) and mask in SAMPLING_MASK_MODES, "return_sampling_mask",
               f"must be false, true, 'threshold' or 'ids', got {mask!r}")
        if mask is True:
            self.return_sampling_mask = "threshold"
        _check(not mask or self.pooling is None, "return_sampling_mask", "an encode request (pooling) samples nothing")
        truncated = self.top_k > 0 or self.top_p < 1 or self.min_p > 0
        _check(mask != "ids" or self.temperature == 0 or truncated, "return_sampling_mask",
               "'ids' needs top_k, top_p or min_p (or temperature 0): without a truncation every token's kept set "
               "is the whole vocabulary; ask 'threshold' (its size and smallest logprob) instead")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise InvalidRequestError(f"SamplingParams.{field} {problem}", field)
