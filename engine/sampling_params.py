"""SamplingParams: what to generate and how, per request (vLLM's field names and defaults)."""
import enum

import msgspec

from engine.errors import InvalidRequestError


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
    max_tokens: None = until the context is full.
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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an int >= 1, got {self.n!r}")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               f"must be an int >= 0 (0 or -1 = off), got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an int, got {self.seed!r}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"must be an int >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.stop is None or all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be a non-empty string or a list of them")
        _check(self.stop_token_ids is None or all(isinstance(t, int) for t in self.stop_token_ids),
               "stop_token_ids", "must be a list of ints")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and 0 <= v <= 20), name, f"must be None or 0..20, got {v!r}")
        _check(self.logprobs_mode in ("processed", "raw"), "logprobs_mode",
               f"must be 'processed' or 'raw', got {self.logprobs_mode!r}")
        _check(self.n == 1 or self.temperature > 0, "n", "n > 1 needs temperature > 0 (greedy copies are identical)")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need detokenize=True", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise InvalidRequestError(f"SamplingParams.{field} {problem}", field)
