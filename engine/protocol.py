"""Payloads between the frontend and the engine core: msgspec Structs, wire-ready (msgpack).

The frontend owns text; the core sees token ids only.
"""
import enum
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token, or a stop string
    LENGTH = 1  # max_tokens or the context is full
    ABORT = 2  # aborted by the caller, or a stop string found by the frontend
    STALE = 3  # a weight update left its oldest token more than max_weight_staleness versions behind

    def __str__(self) -> str:
        return ("stop", "length", "abort", "stale")[self.value]


class RequestType(bytes, enum.Enum):
    """The first frame of every frontend -> core message, so the core dispatches without decoding."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    STREAM_INPUT = b"\x03"
    ADD_MANY = b"\x04"  # a list of requests the core admits together, before its next step
    START_DP_WAVE = b"\x05"  # (coordinator -> core, expert parallelism) every replica steps: engine/process/waves.py


class MMFeature(msgspec.Struct, array_like=True, gc=False):
    """One image of a prompt (engine/frontend/multimodal.py): its preprocessed pixels, the prompt positions
    of its placeholder tokens in order (the vision encoder's output rows go there), and a hash of
    the pixels: the encoder cache's key, and part of the prefix-cache hash of every block that
    holds one of those positions (the placeholders are the same tokens for every image)."""

    hash: str
    positions: list[int]
    pixel_values: Any  # torch.Tensor (tiles, channels, height, width), float32


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    streaming: bool = False  # more input chunks may follow (StreamInput), until one says final
    lora_id: int = 0  # the LoRA adapter (add_lora's lora_int_id) it runs with; 0 = the base model
    mm_features: list[MMFeature] | None = None  # the prompt's images (a vision-language model)
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share blocks


class StreamInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The next chunk of a streaming-input request: appended to its context after what it
    generated so far. `final` with no tokens just closes the input stream."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    final: bool = False


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]


class SamplingMask(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The kept set of one sampled token (SamplingParams.return_sampling_mask): the tokens top-k /
    top-p / min-p left the sampler to draw from. Every filter keeps a prefix of the vocabulary
    ordered by logit, highest first, ties by lower token id (a cut through equal logits keeps the
    lower ids), so the set is the first `num_kept` tokens of that order, all of them at or above
    `min_logprob`.

    Logprobs here are of the distribution before truncation: log-softmax of logits / temperature
    (tokens banned by min_tokens excluded, never kept). `kept_logmass` = log of the kept set's
    probability mass under it, so a "processed" logprob (renormalised over the set) + kept_logmass
    = the untruncated logprob. No truncation: the whole vocabulary (minus banned tokens). Greedy
    (temperature 0): the one token drawn, its logprob of the raw logits. `ids`: the set, highest
    first, when asked ("ids") and at most MAX_SAMPLING_MASK_IDS; else None."""

    num_kept: int
    min_logprob: float
    kept_logmass: float
    ids: list[int] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: at most one new token (more after a resume)."""

    request_id: str
    new_token_ids: list[int]
    weight_version: int = 0
    lora_version: int | None = None  # the request's LoRA adapter's version (None: the base model)
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id, if one ended the request
    num_cached_tokens: int = 0
    resumable: bool = False  # a streaming-input chunk ended, the request waits for more input
    error: str | None = None  # the core refused this request (bad input found there)
    error_type: str | None = None  # InvalidRequestError or a subclass
    pooled: list[float] | None = None  # an encode request's result (it ends with it)
    # (arrived, first scheduled): time.monotonic() in the core, on the output with the first token of
    # the prompt (or of a streaming-input chunk, or after a preemption's recompute); for tracing
    timings: tuple[float, float] | None = None
    # its output so far is void (stale_action "restart"): the frontend drops what it accumulated, and
    # the request generates again from its prompt under the new weights
    restarted: bool = False
    new_sampling_masks: list[SamplingMask] | None = None  # with return_sampling_mask: one per new token
    # with return_routed_experts: (first position, rows) of the positions that became available: little-endian
    # int16 bytes of shape (n, num_layers, top_k), placed by position (engine/routed_experts.py)
    routed_experts: tuple[int, bytes] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None and not self.resumable


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    failure: str | None = None  # the message of the exception the call raised
    failure_type: str | None = None  # its class name (engine.errors.remote_error raises it again)
    failure_param: str | None = None  # the field at fault, for an InvalidRequestError that names one

    @classmethod
    def failed(cls, call_id: int, e: BaseException) -> "UtilityOutput":
        # a KeyError's str() quotes its message
        message = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
        return cls(call_id, failure=message, failure_type=type(e).__name__, failure_param=getattr(e, "param", None))


class Heartbeat(msgspec.Struct, array_like=True, gc=False):
    """Sent by every engine core to every frontend each heartbeat_interval_s, from a thread of
    its own: how long its busy loop has been inside one piece of work (0 when idle), and which
    ("step" or a utility method's name). A core that stops sending, or stays busy past
    engine_stall_timeout_s, is reported stalled by check_health (and /health)."""

    busy_s: float
    doing: str = ""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything the core sends back in one message."""

    outputs: list[EngineCoreOutput] = []
    utility_output: UtilityOutput | None = None
    heartbeat: Heartbeat | None = None
    engine_dead: str | None = None  # the core is going down; the reason
    timestamp: float = 0.0  # time.monotonic() in the core when the step's outputs were queued
    engine_index: int = 0  # which engine core (data-parallel replica) sent it


class EngineLoad(msgspec.Struct, array_like=True, gc=False, tag=True):
    """A replica's queue depth, published to the DP coordinator whenever it changes."""

    engine_index: int
    num_waiting: int  # held requests (arrived while paused) and those awaiting a weight version included
    num_running: int


class WaveEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Expert parallelism (engine/process/waves.py), core -> DP coordinator: a replica entered wave
    `wave` with work of its own (`started`), or every replica finished it (from replica 0)."""

    engine_index: int
    wave: int
    started: bool


# ---- start-up handshake and process wiring ------------------------------------------------------
class Hello(msgspec.Struct):
    """engine core -> its manager, first message on the handshake socket."""

    pid: int


class EngineAddresses(msgspec.Struct):
    """The sockets an engine core connects to (a frontend's ROUTER and PULL per API server)."""

    inputs: list[str]  # one per frontend: the engine's DEALER connects to its ROUTER
    outputs: list[str]  # one per frontend: the engine's PUSH connects to its PULL
    coordinator: str = ""  # the DP coordinator's PULL for load reports ("" = none)
    waves: str = ""  # the DP coordinator's PUB of START_DP_WAVE for expert-parallel engines ("" = none)


class Startup(msgspec.Struct):
    """manager -> engine core: where to connect, and the EngineConfig (as a dict)."""

    addresses: EngineAddresses
    config: dict


class Ready(msgspec.Struct):
    """engine core -> manager once the model is loaded (or why it could not be)."""

    num_blocks: int = 0
    max_model_len: int = 0
    failure: str = ""


class DPLoads(msgspec.Struct, array_like=True, gc=False):
    """DP coordinator -> every frontend: each replica's queue depth, for routing."""

    loads: list[tuple[int, int]]  # (replica index, waiting + running)


class EngineConnection(msgspec.Struct):
    """How a frontend reaches engines another process started (an API server beside others:
    the launcher starts the engines and hands each API server its own sockets' addresses)."""

    input_address: str
    output_address: str
    client_index: int
    client_count: int
    engine_pids: dict[int, int]  # replica index -> pid
    num_blocks: int
    max_model_len: int
    coordinator_address: str = ""  # the DP coordinator's publisher ("" = none)
