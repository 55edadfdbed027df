"""vLLM's RL routes beyond the ones rollout/api/ already serves under vLLM's names, for SkyRL
(NovaSky-AI/SkyRL skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py) and
prime-rl (PrimeIntellect-ai/prime-rl src/prime_rl/utils/client.py, PrimeIntellect-ai/renderers
renderers/client.py). Each route is a translation onto the one engine API (ServerState.generate,
the weight-update routes, AsyncLLM calls): no second pause, push or abort lives here.

    POST /inference/v1/generate {"token_ids", "sampling_params": {vLLM SamplingParams fields},
         "model", "cache_salt", "stream", "request_id", "return_token_ids", ...}
         -> {"request_id", "model", "created", "choices": [{"index", "token_ids", "finish_reason",
             "stop_reason", "logprobs": {"content": [{"token": "token_id:N", "token_id", "logprob",
             "top_logprobs": [...]}]} | null, "weight_versions": [{"version", "start", "end"}]}],
             "usage": {..., "prompt_tokens_details": {"cached_tokens"}}, "prompt_logprobs"}
         (vLLM's tokens-in/tokens-out route, vllm/entrypoints/scale_out/token_in_token_out/; SSE
          deltas ending in `data: [DONE]` with "stream": true; headers X-data-parallel-rank and
          X-Session-ID route it as on /generate)
    POST /update_weight_version {"new_version"}  -> {"success": true, "new_version"}
    POST /weight_checker {"action": "checksum"|"compare", "baseline"}
         -> {"checksums": {"dp<d>:pp0:pcp0:tp<t>:<HF name>": sha256 hex}} | {"match", "mismatches"}
    GET  /liveness                               -> 200 {"status": "ok"} | 503 {"status": "engine_unresponsive"}
    POST /load_lora_adapter {"lora_name", "lora_path"} -> {"status": "ok"} (prime-rl's; in place)
    POST /init_broadcaster                       -> 501 (prime-rl's own NCCL broadcaster; its
         weight_dir null on /update_weights, the same transport, is a 400)
    POST /update_weights {"weight_dir"}          -> {"status": "ok", "weight_version", ...}
         (prime-rl's body on our /update_weights route, told apart from vLLM's {"update_info"} by
          rollout/api/dispatch.py; `update_weights_from_dir` below)

Versions are integers here (vLLM's are strings): a version that is not an integer is a 400 naming
it, and versions only increase (a lower one is a 409). Not served: SkyRL's /skyrl/v1/generate (it
differs from /inference/v1/generate only by routed experts, which a dense model does not have),
multimodal `features` (vLLM-serialized processor tensors), `priority` other than 0, kv/ec transfer
parameters, output_mode "text", and vLLM's `reset` action of /weight_checker (it zeroes the live
weights). Errors take our shape ({"error": {"message", "type", "param", "code"}}), which the
clients read: SkyRL's raise_for_status takes `error.message`, prime-rl's raise_for_status the status.
"""
import math
import time
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, field_validator

from engine.errors import InvalidRequestError
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.timeouts import wait_within
from rollout.api.cancel import until_disconnect
from rollout.api.control import call
from rollout.api.control import load_lora_adapter as load_lora_adapter_v1
from rollout.api.dispatch import parse, register
from rollout.api.errors import APIError, engine_error
from rollout.api.generate import final_output, tokenize_prompts
from rollout.api.protocol import LoadLoRARequest, StreamOptions, _Strict, make_sampling_params
from rollout.api.state import get_state, request_route
from rollout.api.streaming import DONE, error_event, merge, prime, sse
from rollout.api.weights import _timed_update

router = APIRouter(tags=["compat"])
LIVENESS_TIMEOUT_S = 30.0  # prime-rl's server.liveness_timeout_seconds default
LOGPROB_FLOOR = -9999.0  # vLLM's clamp for -inf / NaN logprobs (JSON has neither)
TENSOR_CHECKSUMS = "weight_sync.checksum:tensor_digests"  # run on every worker by apply_model
MAX_VERSION = (1 << 63) - 1  # (an update adds 1: it still fits the wire's 64 bits)


# ---- POST /inference/v1/generate ----------------------------------------------------------------
class VLLMSamplingParams(_Strict):
    """vLLM's SamplingParams as a JSON dict (vllm/sampling_params.py). The fields the engine has
    map one to one; those it lacks are accepted at their neutral value only (`_NEUTRAL`); those
    that change nothing in a tokens-only answer (spaces_between_special_tokens, output_kind,
    stream_interval, skip_clone, flat_logprobs, routed_experts_prompt_start,
    output_text_buffer_length) are accepted and ignored; any other name is a 400. Leaving max_tokens out samples up to the context's end, as vLLM's server does."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # (-1 = off, as 0)
    min_p: float = 0.0
    seed: int | None = None
    stop: None | str | list[str] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs_mode: Literal["processed", "raw"] = "processed"  # ours (vLLM sets it per server)
    # no counterpart in this engine: the neutral value only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_decoding: dict[str, Any] | None = None
    logits_processors: list[Any] | None = None
    extra_args: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprob_token_ids: list[Any] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None
    trace_decode_token_ids: list[int] | None = None
    watermarking: bool | None = None
    skip_reading_prefix_cache: bool | None = None
    # no effect on token ids and logprobs: accepted, ignored
    spaces_between_special_tokens: bool = True
    output_kind: int | None = None  # the server picks it (delta when streaming), as vLLM's does
    stream_interval: int | None = None
    skip_clone: bool = False
    flat_logprobs: bool = False
    routed_experts_prompt_start: int = 0
    output_text_buffer_length: int = 0

    def to_engine(self, kind: RequestOutputKind) -> SamplingParams:
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if value != neutral and not (neutral is None and not value):
                raise APIError(400, f"sampling_params.{name} is not supported by this engine (only "
                                    f"{'unset' if neutral is None else neutral})", f"sampling_params.{name}")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "sampling_params.best_of is not supported (only best_of == n)",
                           "sampling_params.best_of")
        try:
            return make_sampling_params(dict(self.model_dump(include=_ENGINE_FIELDS), output_kind=kind))
        except InvalidRequestError as e:
            err = engine_error(e)
            raise APIError(400, str(e), f"sampling_params.{err.param}" if err.param else "sampling_params") from e


_ENGINE_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
                  "include_stop_str_in_output", "logprobs_mode"}
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            **{name: None for name in ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs",
                                       "guided_decoding", "logits_processors", "extra_args", "truncate_prompt_tokens",
                                       "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids",
                                       "thinking_token_budget", "repetition_detection", "trace_decode_token_ids",
                                       "watermarking", "skip_reading_prefix_cache")}}


class VLLMGenerateRequest(_Strict):
    """vLLM's GenerateRequest (vllm/entrypoints/scale_out/token_in_token_out/protocol.py)."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: VLLMSamplingParams = Field(default_factory=VLLMSamplingParams)
    request_id: str | None = Field(default=None, min_length=1)
    model: str | None = None  # the served model or a loaded LoRA adapter's name
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # the prompt's token ids in the answer
    priority: int = 0
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    # what a render step passes along; it changes nothing here (structured outputs are refused)
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    token_offsets: list[list[int]] | None = None
    assistant_tokens_mask: list[int] | None = None

    @field_validator("token_ids")
    @classmethod
    def _no_negatives(cls, ids: list[int]) -> list[int]:
        if any(t < 0 for t in ids):
            raise ValueError("token_ids must not contain negative values")
        return ids

    def check_supported(self) -> None:
        if self.priority != 0:
            raise APIError(400, f"priority {self.priority} needs priority scheduling, which this engine does not "
                                "have (only 0)", "priority")
        for name, why in _NOT_SERVED.items():
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this server ({why})", name)
        if self.output_mode != "tokens":
            raise APIError(400, "output_mode 'text' is not supported here: use /v1/completions with "
                                "return_token_ids, or detokenize with /detokenize", "output_mode")


_NOT_SERVED = {  # GenerateRequest fields that take a feature this server lacks: null only
    "features": "multimodal features serialized by vLLM's own processor; send images as data URLs to /generate "
                "or /v1/chat/completions instead",
    "content_parts": "multimodal inputs; send images as data URLs to /generate or /v1/chat/completions instead",
    "kv_transfer_params": "disaggregated prefill",
    "ec_transfer_params": "encoder-cache disaggregation",
}


@router.post("/inference/v1/generate", tags=["generate"])
async def inference_generate(body: VLLMGenerateRequest, request: Request):
    """vLLM's tokens-in / tokens-out route, as SkyRL's RemoteInferenceClient._generate_single and
    the renderers client's vllm_generate transport call it."""
    state = get_state(request)
    state.check_can_generate()
    body.check_supported()
    stream = bool(body.stream)
    params = body.sampling_params.to_engine(RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    lora = state.resolve_model(body.model)
    [ids] = await tokenize_prompts(state, [body.token_ids], "token_ids", False, params, "sampling_params.")
    rid = state.new_request_id(body.request_id or request.headers.get("x-request-id"), "generate-tokens")
    model = body.model if lora is not None else state.model_name
    gen = state.generate(ids, params, rid, "token_ids", lora, body.cache_salt, request_route(request))
    headers = {"X-Request-Id": rid}
    if not stream:
        out = await until_disconnect(request, final_output(gen))
        return JSONResponse(_response(out, params, rid, model, bool(body.return_token_ids)), headers=headers)
    firsts = await prime([gen], request)
    return StreamingResponse(_events(gen, firsts, params, rid, body), media_type="text/event-stream", headers=headers)


def _response(out: RequestOutput, params: SamplingParams, rid: str, model: str, return_token_ids: bool) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"request_id": rid, "model": model, "created": int(time.time()),
            "choices": [_choice(c, params, c.weight_versions, final=True) for c in out.outputs],
            "usage": _usage(out, completion), "prompt_logprobs": _prompt_logprobs(out),
            "prompt_token_ids": out.prompt_token_ids if return_token_ids else None, "kv_transfer_params": None}


def _choice(c: CompletionOutput, params: SamplingParams, versions: list[int], final: bool) -> dict:
    """One choice; a streamed one carries its delta, and its whole output's versions when it ends."""
    d = {"index": c.index, "token_ids": c.token_ids,
         "finish_reason": c.finish_reason or ("stop" if final else None), "stop_reason": c.stop_reason,
         "logprobs": _logprobs(c, params.logprobs) if params.logprobs is not None else None,
         "routed_experts": None}
    if c.finish_reason is not None:
        d["weight_versions"] = _version_spans(versions)
    return d


def _usage(out: RequestOutput, num_completion: int) -> dict:
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": num_completion, "total_tokens": prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


def _entry(token_id: int, logprob: float, rank: int | None) -> dict:
    """A (token, logprob) pair in both of vLLM's generate shapes: "token": "token_id:N" (the older
    one, which SkyRL and prime-rl were written against) and "token_id" (vLLM 0.32's)."""
    return {"token": f"token_id:{token_id}", "token_id": token_id, "logprob": _clamp(logprob), "rank": rank,
            "bytes": None}


def _logprobs(c: CompletionOutput, k: int) -> dict:
    """vLLM's _create_tokens_logprobs: per token its logprob and max(k, 1) candidates, the sampled
    token first, then the best others. A rank is the position among this step's top k (null
    where the sampled token is not in it: the engine does not compute ranks beyond)."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(c.token_ids, c.logprobs or [])):
        top = sorted((c.top_logprobs[i] if c.top_logprobs else {}).items(), key=lambda t: -t[1])
        rank = {t: r for r, (t, _) in enumerate(top, 1)}
        entries = [_entry(token_id, logprob, rank.get(token_id))]
        entries += [_entry(t, lp, rank[t]) for t, lp in top if t != token_id]
        content.append(dict(entries[0], top_logprobs=entries[:max(k, 1)]))
    return {"content": content}


def _prompt_logprobs(out: RequestOutput) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for it and its top-k alternatives."""
    if out.prompt_logprobs is None:
        return None
    rows = []
    for i, (token_id, logprob) in enumerate(zip(out.prompt_token_ids, out.prompt_logprobs)):
        if logprob is None:
            rows.append(None)
            continue
        top = sorted(((out.prompt_top_logprobs or [None] * (i + 1))[i] or {}).items(), key=lambda t: -t[1])
        row = {str(t): {"logprob": _clamp(lp), "rank": r, "decoded_token": None} for r, (t, lp) in enumerate(top, 1)}
        row.setdefault(str(token_id), {"logprob": _clamp(logprob), "rank": None, "decoded_token": None})
        rows.append(row)
    return rows


def _version_spans(versions: list[int]) -> list[dict]:
    """vLLM's WeightVersionSpan list: output tokens [start, end) sampled by weights `version` (a
    string in vLLM's type; our integer versions written out)."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


async def _events(gen, firsts: list, params: SamplingParams, rid: str, body: VLLMGenerateRequest):
    """vLLM's stream: one chunk per choice with new tokens (or its end), a usage chunk when asked
    (stream_options.include_usage), then `data: [DONE]`; an error mid-stream is one error chunk."""
    opts = body.stream_options
    versions: dict[int, list[int]] = {}
    num_tokens: dict[int, int] = {}
    last: RequestOutput | None = None
    sent_prompt = not body.return_token_ids
    async for _, out in merge([gen], firsts):
        if isinstance(out, BaseException):
            yield sse(error_event(out))
            break
        last = out
        for c in out.outputs:
            versions.setdefault(c.index, []).extend(c.weight_versions)
            num_tokens[c.index] = num_tokens.get(c.index, 0) + len(c.token_ids)
            if not c.token_ids and c.finish_reason is None:
                continue
            chunk = {"request_id": rid, "choices": [_choice(c, params, versions[c.index], final=False)]}
            if not sent_prompt:
                chunk["prompt_token_ids"], sent_prompt = out.prompt_token_ids, True
            if opts is not None and opts.continuous_usage_stats:
                chunk["usage"] = _usage(out, num_tokens[c.index])
            yield sse(chunk)
    if last is not None and opts is not None and opts.include_usage:
        yield sse({"request_id": rid, "choices": [], "usage": _usage(last, sum(num_tokens.values()))})
    yield DONE


# ---- weight versions and checks -------------------------------------------------------------------
class UpdateWeightVersionBody(_Strict):
    """vLLM's /update_weight_version body (a string there; an integer, or its digits, here)."""

    new_version: int | str
    abort_all_requests: bool = False  # SGLang's field on the same route (its default is true there)


@router.post("/update_weight_version", tags=["admin"])
async def update_weight_version(body: UpdateWeightVersionBody, request: Request):
    """Relabel the live weights (tokens sampled from now on carry the new version). Versions only
    increase: a lower one is a 409 (the same one is a no-op); not during a
    /start_weight_update .. /finish_weight_update sequence, whose finish sets the version."""
    version = _int_version(body.new_version)
    state = get_state(request)
    async with state.control_lock:
        if state.weight_update is not None:
            raise APIError(409, "a weight update is in progress (/start_weight_update): its /finish_weight_update "
                                "sets the version", "new_version")
        if body.abort_all_requests:
            await call(state.abort_all_in_flight())
        try:
            await state.engine.set_weight_version(version)
        except Exception as e:  # (the engine names its own field, weight_version: this body's is new_version)
            err = engine_error(e, "new_version")
            raise APIError(err.status, err.message, "new_version", err.type) from e
    return {"success": True, "message": f"Weight version updated to {version}.", "new_version": str(version),
            "weight_version": version}


def _int_version(value: int | str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_VERSION:
        return value
    raise APIError(400, f"new_version must be an integer in [0, 2^63) (this server's weight versions are "
                        f"integers that only increase), got {value!r}", "new_version")


class WeightCheckerBody(_Strict):
    """vLLM's /weight_checker body (vllm/entrypoints/rl/online/api_router.py)."""

    action: Literal["checksum", "reset", "compare"]
    baseline: dict[str, str] | None = None


@router.post("/weight_checker", tags=["admin"])
async def weight_checker(body: WeightCheckerBody, request: Request):
    """Per-tensor sha256 of the live weights, one set per worker (each tensor-parallel rank hashes
    its own slices, as vLLM's workers do), keyed "dp<replica>:pp0:pcp0:tp<rank>:<HF name>"; or
    their comparison with a baseline the caller kept. The tensors are the Hugging Face ones the
    model serves (a fused projection's parts one by one), raw bytes in the serving dtype, so a
    trainer can hash its own shards the same way. "reset" (vLLM zeroes the weights, a test hook of
    its weight-transfer tests) is refused: nothing here destroys the weights that serve; POST
    /reload_weights brings back the start-up checkpoint."""
    if body.action == "reset":
        raise APIError(400, "action 'reset' (zero the live weights) is not supported: this server never destroys "
                            "the weights it serves; POST /reload_weights restores the start-up checkpoint", "action")
    if body.action == "compare" and body.baseline is None:
        raise APIError(400, "action='compare' requires a 'baseline' object", "baseline")
    state = get_state(request)
    tp = state.engine.config.tensor_parallel_size
    per_worker = await call(state.engine.apply_model(TENSOR_CHECKSUMS))
    checksums = {f"dp{i // tp}:pp0:pcp0:tp{i % tp}:{name}": digest
                 for i, digests in enumerate(per_worker) for name, digest in digests.items()}
    if body.action == "checksum":
        return {"checksums": checksums}
    mismatches = sorted(k for k in checksums.keys() | body.baseline.keys() if checksums.get(k) != body.baseline.get(k))
    return {"match": not mismatches, "mismatches": mismatches}


# ---- prime-rl's routes ---------------------------------------------------------------------------
class WeightDirBody(_Strict):
    """prime-rl's /update_weights body (src/prime_rl/inference/vllm/server.py)."""

    weight_dir: str | None
    skip_prefix_cache_reset: bool = False  # (older prime-rl) accepted, not honoured: caches always clear


async def update_weights_from_dir(request: Request, data: dict) -> dict:
    """prime-rl's POST /update_weights {"weight_dir"} (its filesystem transport: the trainer wrote a
    Hugging Face checkpoint there): our update from disk, atomic, the version + 1, the prefix and
    encoder caches cleared (always: KV of old weights is never reused). weight_dir null is
    prime-rl's NCCL transport, which is not here: a 400 naming our weight routes."""
    body = parse(WeightDirBody, data)
    if body.weight_dir is None:
        raise APIError(400, "weight_dir null means prime-rl's own NCCL broadcaster, which this server does not "
                            "have: push with /init_weight_transfer_engine and /update_weights {\"update_info\"} "
                            "(weight_sync.WeightSender), or give a checkpoint folder as weight_dir", "weight_dir")
    if not Path(body.weight_dir).is_dir():
        raise APIError(400, f"weight_dir {body.weight_dir!r} is not a folder on the server", "weight_dir")
    state = get_state(request)
    result = await _timed_update(state, "disk", state.engine.update_weights_from_disk(body.weight_dir), "weight_dir")
    return dict(result, status="ok")


register("/update_weights", lambda data: "weight_dir" in data, update_weights_from_dir, WeightDirBody)


@router.get("/liveness", tags=["info"])
async def liveness(request: Request, timeout_s: float = Query(LIVENESS_TIMEOUT_S, ge=1, le=600)):
    """prime-rl's probe: a no-op call through every engine core to every worker (ping), answered
    within `timeout_s`; 503 {"status": "engine_unresponsive"} when one is stuck or gone. /health
    looks at heartbeats instead; this one proves a call gets through."""
    engine = get_state(request).engine
    try:
        await wait_within(engine.collective_rpc("ping", timeout=timeout_s), timeout_s + 1.0)
    except Exception as e:  # noqa: BLE001 - timed out, dead, or refusing: all unresponsive
        return JSONResponse({"status": "engine_unresponsive", "error": f"{type(e).__name__}: {e}"}, status_code=503)
    return {"status": "ok"}


@router.post("/load_lora_adapter", tags=["admin"])
async def load_lora_adapter(body: LoadLoRARequest, request: Request):
    """prime-rl's route: vLLM's /v1/load_lora_adapter with load_inplace forced (a name loaded again
    takes the new weights). prime-rl's server also resets the prefix cache; here the adapter
    loaded again gets a new id, and prefix blocks are keyed by it, so old KV is never reused."""
    await load_lora_adapter_v1(LoadLoRARequest(lora_name=body.lora_name, lora_path=body.lora_path,
                                               load_inplace=True), request)
    return {"status": "ok", "lora_name": body.lora_name}


@router.post("/init_broadcaster", tags=["admin"])
async def init_broadcaster(request: Request):
    """prime-rl's own NCCL broadcaster (its worker extension): not here. 501 naming the routes that
    move weights into this server."""
    raise APIError(501, "/init_broadcaster is prime-rl's own NCCL broadcaster, which this server does not have: "
                        "write a checkpoint and POST /update_weights {\"weight_dir\"} (prime-rl's filesystem "
                        "transport), or push over NCCL/gloo with /init_weight_transfer_engine and /update_weights "
                        "{\"update_info\"}", type="not_implemented_error")

