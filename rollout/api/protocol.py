"""Request bodies (pydantic, strict: a wrong type is an error, not a coercion; an unknown field is
an error, so a typo such as `max_token` is refused instead of silently ignored) and their
translation into the engine's SamplingParams.

OpenAI fields we do not implement (penalties, logit_bias, best_of != n, suffix) are accepted at
their neutral value and refused otherwise, naming the field.
"""
import os
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import RequestOutputKind, SamplingParams
from rollout.api.errors import APIError

PromptInput = str | list[int] | list[str | list[int]]


# what msgpack carries to the engine core: a larger int would fail there, after the request was taken
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
MAX_GROUP_TIMEOUT_S = 600.0  # forming a weight transfer group waits at most this long


def check_wire_values(value: Any, path: str = "") -> None:
    """Refuse (400, naming the field) what the engine core cannot take, anywhere in a body: an
    integer msgpack cannot carry, a string that is not valid Unicode (a lone surrogate such as
    "\\ud800", which JSON can spell but UTF-8 cannot encode: tokenizers fail on it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{path or 'the body'} is not valid Unicode: a lone surrogate "
                                f"U+{ord(value[e.start]):04X} at character {e.start}", path or None) from None
    elif isinstance(value, int) and not isinstance(value, bool):
        if not INT_MIN <= value <= INT_MAX:
            raise APIError(400, f"{path or 'the body'} is out of range: integers must lie in "
                                f"[-2^63, 2^64), got {value}", path or None)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_wire_values(k, f"{path} (a key)" if path else "a key")
            check_wire_values(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_wire_values(v, f"{path}[{i}]")


PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # neutral values


def refuse_penalties(values, prefix: str = "") -> None:
    """A 400 naming the first sampling penalty (OpenAI's, vLLM's, SGLang's) set to anything but
    its neutral value: the engine has none. `values`: a body (attributes) or a dict."""
    for name, neutral in PENALTIES.items():
        value = values.get(name, neutral) if isinstance(values, dict) else getattr(values, name, neutral)
        if value != neutral:
            raise APIError(400, f"{name} is not supported by this engine (only {neutral})", prefix + name)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _values_fit(cls, data: Any) -> Any:
        check_wire_values(data)  # the outermost body runs first, so the path is complete
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: None | str | list[str] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    return_token_ids: bool = False  # add token ids (prompt and completion) to the response
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:<id>", not text
    request_id: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: a prefix-cache namespace
    structured_outputs: dict[str, Any] | None = None  # vLLM's guided decoding: refused (named, not "unknown")
    # ours (engine/core/staleness.py), sent as vLLM's extra_body fields are
    max_weight_staleness: int | None = None
    min_weight_version: int | None = None
    stale_action: str = "finish"
    # ours, as SGLang's request field (vLLM returns them to every request when started with the flag):
    # each choice's `routed_experts` (rollout/api/output_json.py)
    return_routed_experts: bool = False

    def check_unsupported(self) -> None:
        refuse_penalties(self)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this engine", "logit_bias")
        if self.structured_outputs:
            raise APIError(400, "structured_outputs (guided decoding: regex, json, grammar, choice) is not "
                                "supported by this engine", "structured_outputs")

    def sampling_kwargs(self) -> dict:
        kw: dict[str, Any] = dict(n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                                  min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens,
                                  max_weight_staleness=self.max_weight_staleness,
                                  min_weight_version=self.min_weight_version, stale_action=self.stale_action,
                                  return_routed_experts=self.return_routed_experts)
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw


class CompletionRequest(_OpenAISampling):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None  # top-k alternatives per token (OpenAI: 0..5; we allow 0..20)
    prompt_logprobs: int | None = None  # vLLM's: each choice's `prompt_logprobs`, top-k per prompt token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported (only best_of == n)", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    @property
    def scores_prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt's logprobs alone (how evaluation harnesses score
        choices). The engine samples one token, which the answer leaves out."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, output_kind: RequestOutputKind) -> SamplingParams:
        self.check_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 needs echo: true (scoring the prompt)", "max_tokens")
        prompt_logprobs = self.prompt_logprobs  # (vLLM's rule: echo with logprobs scores the prompt too)
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return make_sampling_params(dict(self.sampling_kwargs(), max_tokens=1 if self.scores_prompt_only
                                         else self.max_tokens, logprobs=self.logprobs,
                                         prompt_logprobs=prompt_logprobs, output_kind=output_kind))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # tool_calls, name, ... pass to the template
    role: str
    content: None | str | list[ContentPart] = None

    def to_template(self) -> dict:
        """The message as engine.frontend.processor.Processor.apply_chat_template reads it."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "none" (TRL's): tools rendered into the prompt, no call parsed
    chat_template: str | None = None  # vLLM's: refused, as vLLM does without --trust-request-chat-template
    prefix_token_ids: list[int] | None = None  # ours: the ids of the turns so far, kept (rollout/api/chat_prefix.py)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.chat_template is not None:
            raise APIError(400, "chat_template: this server renders with the model's own chat template only "
                                "(a template sent in a request is not trusted)", "chat_template")
        if self.prefix_token_ids is not None and self.continue_final_message:
            raise APIError(400, "continue_final_message with prefix_token_ids: to continue the last assistant "
                                "turn, send its ids as the prompt (/generate prompt_token_ids)", "continue_final_message")

    def to_sampling_params(self, output_kind: RequestOutputKind) -> SamplingParams:
        self.check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return make_sampling_params(dict(self.sampling_kwargs(), max_tokens=max_tokens,
                                         logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                                         output_kind=output_kind))


class GenerateSamplingParams(_Strict):
    """The engine's SamplingParams, field for field (output_kind is the server's business)."""

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
    logprobs_mode: Literal["processed", "raw"] = "processed"
    detokenize: bool = True
    skip_special_tokens: bool = True
    max_weight_staleness: int | None = None
    min_weight_version: int | None = None
    stale_action: str = "finish"  # (checked by SamplingParams: its message names the choices)
    temp_scaled_prompt_logprobs: bool = False
    return_sampling_mask: bool | Literal["threshold", "ids"] = False  # each token's kept set (output_json.py)
    return_routed_experts: bool = False  # each token's experts per layer (a MoE model; output_json.py)


class SessionParams(_Strict):
    """/generate's `session_params` (SGLang's name): the session this prompt is the next turn of.
    SGLang's branching fields (rid, offset, replace) have no counterpart: a session here is one
    linear conversation."""

    id: str


class GenerateRequest(_Strict):
    """/generate: text prompts (`prompt`, as they are: no chat template, no BOS), token ids
    (`prompt_token_ids`), one or a batch, or one conversation (`messages`, rendered with the
    model's chat template and `chat_template_kwargs` / `tools`, as /v1/chat/completions does)."""

    prompt: str | list[str] | None = None
    prompt_token_ids: list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prefix_token_ids: list[int] | None = None  # with messages: the turns so far, as ids (rollout/api/chat_prefix.py)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    stream_format: Literal["ndjson", "sse"] = "ndjson"
    request_id: str | None = None
    session_params: SessionParams | None = None  # a turn of a session (rollout/api/sessions.py)
    model: str | None = None  # the served model (default) or a loaded LoRA adapter's name
    multi_modal_data: dict[str, list[str]] | None = None  # {"image": [data URLs]} for one text prompt
    cache_salt: str | None = Field(default=None, min_length=1)  # prefix blocks shared only within a salt

    def prompts(self) -> tuple[list[str | list[int]], str, bool]:
        """(prompts, the field they came from, whether the request was a batch); `messages` are
        rendered by the route (they need the tokenizer)."""
        if sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)) != 1:
            raise APIError(400, "give exactly one of 'prompt' (text), 'prompt_token_ids' and 'messages'", "prompt")
        if self.prefix_token_ids is not None and self.messages is None:
            raise APIError(400, "prefix_token_ids goes with messages (the whole conversation: the turns the prefix "
                                "covers and the new ones)", "prefix_token_ids")
        if self.messages is not None:
            return [], "messages", False
        if self.prompt is not None:
            batch = isinstance(self.prompt, list)
            prompts = list(self.prompt) if batch else [self.prompt]
            field = "prompt"
        else:
            ids = self.prompt_token_ids
            batch = bool(ids) and isinstance(ids[0], list)
            prompts = [list(p) for p in ids] if batch else [list(ids)]
            field = "prompt_token_ids"
        if not prompts:
            raise APIError(400, f"{field} is an empty batch", field)
        return prompts, field, batch


def make_sampling_params(kw: dict) -> SamplingParams:
    """SamplingParams(**kw); its checks name the field (InvalidRequestError -> 400)."""
    return SamplingParams(**kw)


def normalize_prompts(prompt: PromptInput, field: str = "prompt") -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, token ids, or a list of either -> a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, f"{field} is empty", field)
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if any(isinstance(t, int) for t in prompt):
        raise APIError(400, f"{field} mixes token ids and prompts", field)
    return list(prompt)


# ---- control bodies -----------------------------------------------------------------------------
MAX_ABORT_WAIT_S = 600.0


class AbortRequestsBody(_Strict):
    """/abort_requests: vLLM's `request_ids` (none: every request in flight, or say `all`), and
    ours: `wait` for the aborted requests to end and answer with their manifest
    (rollout/api/abort_manifest.py), at most `timeout_s`."""

    request_ids: list[str] | None = None
    all: bool = False
    wait: bool = False
    timeout_s: float = Field(default=60.0, gt=0, le=MAX_ABORT_WAIT_S)
    return_prompt_token_ids: bool = False  # (with wait) each manifest entry carries its prompt's ids

    @model_validator(mode="after")
    def _all_or_ids(self):
        if self.all and self.request_ids:
            raise APIError(400, "give request_ids or all: true, not both", "all")
        return self


class CollectiveRPCBody(_Strict):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(default=None, gt=0)


class ApplyModelBody(_Strict):
    fn: str  # the import path of a function registered with --apply-model-fn


class ScaleBody(_Strict):
    data_parallel_size: int = Field(ge=1)
    drain_timeout_s: float = Field(60.0, ge=0)


class ScaleElasticEPBody(_Strict):
    """vLLM's /scale_elastic_ep body."""

    new_data_parallel_size: int = Field(ge=1)
    drain_timeout: float = Field(120.0, ge=0)


def _host(address: str) -> str:
    """A host name or IP address a socket can take (checked without a lookup: a name the resolver
    cannot even encode failed deep in the group's forming, as a 500)."""
    try:
        address.encode("idna")
    except UnicodeError:
        raise ValueError(f"not a host name or IP address: {address[:80]!r}") from None
    return address


HostAddress = Annotated[str, Field(min_length=1, max_length=253), AfterValidator(_host)]


class InitInfo(_Strict):
    master_address: HostAddress
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    rank_offset: int = 1
    backend: Literal["gloo", "nccl"] | None = None
    timeout_s: float = Field(default=60.0, gt=0, le=MAX_GROUP_TIMEOUT_S)
    # (ours) only these data-parallel replicas' workers join; the trainer writes the others'
    # part through shared memory (/weights/update's handles beside the group's push)
    replicas: list[int] | None = Field(default=None, min_length=1)


class InitWeightTransferBody(_Strict):
    init_info: InitInfo


class StartWeightUpdateBody(_Strict):
    is_checkpoint_format: bool = True


class UpdateInfo(BaseModel):
    """vLLM's NCCL update_info. Our wire protocol carries names, dtypes and shapes itself, so
    they are only checked for consistency here; `weight_version` (ours) labels the new weights
    at the moment they are swapped in. `lora_name` (ours): the push holds that LoRA adapter's
    tensors (PEFT names) and `weight_version` is the adapter's."""

    model_config = ConfigDict(extra="allow", strict=True)
    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None
    packed: bool = False
    weight_version: int | None = None
    lora_name: str | None = None

    @model_validator(mode="after")
    def _same_lengths(self):
        lengths = {k: len(v) for k, v in (("names", self.names), ("dtype_names", self.dtype_names),
                                          ("shapes", self.shapes)) if v is not None}
        if len(set(lengths.values())) > 1:
            raise APIError(400, f"names, dtype_names and shapes must have the same length, got {lengths}",
                           "update_info")
        return self


class UpdateWeightsBody(_Strict):
    update_info: UpdateInfo = Field(default_factory=UpdateInfo)


class ResetPrefixCacheBody(_Strict):
    """vLLM's /reset_prefix_cache flags (query parameters there) as a JSON body, as SkyRL sends them."""

    reset_running_requests: bool = False
    reset_external: bool = False


class FinishWeightUpdateBody(_Strict):
    weight_version: None | int | str = None


class UpdateFromDiskBody(_Strict):
    path: str
    version: int | None = None
    lora_name: str | None = None  # the path is a PEFT folder: that loaded adapter's new weights


class ReloadWeightsBody(_Strict):
    version: int | None = None


class SaveWeightsBody(_Strict):
    path: str  # a folder on the server's disk
    overwrite: bool = False
    max_shard_bytes: int | None = Field(None, ge=1)  # None: the engine's default (5 GB)

    @model_validator(mode="after")
    def _absolute(self):
        check_absolute(self.path, "path")
        return self


def check_absolute(path: str, param: str) -> None:
    """A relative path would mean the server's working directory, which the caller cannot see:
    refused rather than read from, or written into, an unknown folder."""
    if not os.path.isabs(path):
        raise APIError(400, f"{param} must be an absolute folder on the server's disk, got {path!r}", param)


class LeaseSpareBody(_Strict):
    holder: str = Field(min_length=1)  # the trainer's own id: its retries lease again, others wait
    layouts: list[str] = []  # the engine kernels' pack functions the trainer runs (SpareWriter.layouts)
    replicas: list[int] | None = Field(default=None, min_length=1)  # only these replicas lend theirs


class UpdateFromIPCBody(_Strict):
    handles: dict  # from weight_sync.SharedWeights.share(): {"kind", "tensors", ...}
    version: int | None = None
    lora_name: str | None = None  # the tensors are that loaded adapter's (PEFT names)


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text `prompt`, or `messages` rendered with the chat template."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None
    return_token_strs: bool = False
    model: str | None = None


class DetokenizeRequest(_Strict):
    tokens: list[int]
    model: str | None = None


class _PoolingInput(_Strict):
    model: str | None = None
    input: PromptInput
    pooling: Literal["last", "mean"] = "last"  # ours: the final hidden state at the last token, or the mean
    request_id: str | None = None
    user: str | None = None


class EmbeddingRequest(_PoolingInput):
    """OpenAI's /v1/embeddings (+ vLLM's `normalize`; `dimensions` is refused: no Matryoshka)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool = True


class PoolingRequest(_PoolingInput):
    """vLLM's /pooling: the raw pooled vector (a classifier's label logits: a reward model's score)."""


class ClassificationRequest(_PoolingInput):
    """vLLM's /classify: label probabilities of a sequence classifier."""


class LoadLoRARequest(_Strict):
    """vLLM's /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # replace an adapter of that name


class UnloadLoRARequest(_Strict):
    """vLLM's /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


MAX_SESSION_TIMEOUT_S = 24 * 3600.0


class OpenSessionBody(_Strict):
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_SESSION_TIMEOUT_S)


class CloseSessionBody(_Strict):
    session_id: str

