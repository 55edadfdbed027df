"""SGLang's route dialect, as slime and AReaL drive it (SGLang 0.5.23's http_server.py and
io_struct.py; slime's sglang_engine.py / sglang_rollout.py; AReaL's remote_inf_engine.py):

    POST /generate {input_ids | text, sampling_params {max_new_tokens, ...}, return_logprob,
         logprob_start_len, top_logprobs_num, rid, stream, return_routed_experts,
         routed_experts_start_len}   (our /generate tells the bodies apart)
         -> {text, output_ids, meta_info {id, finish_reason {type, ...}, prompt_tokens,
             completion_tokens, cached_tokens, weight_version, output_token_logprobs
             [[logprob, id, null], ...], input_token_logprobs, e2e_latency, routed_experts (base64
             of int32 (positions, num_layers, top_k), flattened, -1 in dense layers)}} (a list for a batch)
    POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
         group_name, backend}            -> {success, message}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version,
         load_format, flush_cache, abort_all_requests}   -> {success, message}
    POST /destroy_weights_update_group {group_name}; POST /update_weights_from_disk {model_path,
         weight_version, abort_all_requests} (our route name: told apart by the body)
    POST /pause_generation {mode: abort|retract|in_place}, /continue_generation,
         GET|POST /flush_cache, POST /abort_request {rid | abort_all}, GET /v1/loads,
         POST /release_memory_occupation {tags}, /resume_memory_occupation {tags},
         GET /get_weight_version, /health_generate, /get_server_info, /get_model_info

Each is a translation onto the engine API; our guarantees hold in this dialect too: an update
is atomic over every rank of every replica, versions increase strictly, and the prefix cache is
cleared with every update (so `flush_cache: false` is accepted and has no effect: a prefix
computed by the old weights must not serve the new ones). Failures answer SGLang's shapes:
{"success": false, "message"} with 400 on the weight routes, {"error": {"message", ...}} elsewhere.

The weight wire is SGLang's (weight_sync/named.py): the group is a named torch.distributed group
(the trainer's init_custom_process_group meets it), then one broadcast per tensor in `names`
order, or one uint8 buffer with load_format "flattened_bucket". A push that will be refused is
still received whole, so the trainer's broadcasts never hang on us.
"""
import base64
import datetime
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.process.replicas import Route
from engine.process.utility import UpdateTrace
from engine.sampling_params import RequestOutputKind
from engine.timeouts import wait_within
from rollout.api.cancel import gather_all, until_disconnect
from rollout.api.control import call
from rollout.api.dispatch import parse, register
from rollout.api.errors import APIError
from rollout.api.generate import final_output, tokenize_prompts
from rollout.api.protocol import HostAddress, check_wire_values, make_sampling_params, refuse_penalties
from rollout.api.state import ServerState, get_state
from rollout.api.streaming import DONE, merge, prime, sse
from rollout.log import log

router = APIRouter(tags=["sglang"])
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
PAUSE_MODES = {"abort": ("abort", False), "in_place": ("keep", False), "retract": ("keep", True)}


class _Body(BaseModel):
    """SGLang's request structs ignore unknown keys (AReaL sends `pp_rank`, slime nulls) and
    coerce numbers given as strings (AReaL's master_port): so do these."""

    model_config = ConfigDict(extra="ignore")


class SGLangSamplingParams(BaseModel):
    """SGLang's sampling_params (unknown keys are refused there too)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # (decoding here always joins them as the tokenizer does)
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stream_interval: int | None = None  # (every token is streamed)
    custom_params: dict[str, Any] | None = None  # slime's return_top_p_token_ids hint: nothing to return here
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None

    def to_engine(self, logprobs: int | None, prompt_logprobs: int | None, kind: RequestOutputKind,
                  routed_experts: bool = False):
        refuse_penalties(self, "sampling_params.")
        for name in ("json_schema", "regex", "ebnf"):
            if getattr(self, name) is not None:
                raise APIError(400, f"constrained decoding ({name}) is not supported by this engine",
                               f"sampling_params.{name}")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this engine", "sampling_params.logit_bias")
        kw = dict(n=self.n, temperature=self.temperature, top_p=self.top_p, min_p=self.min_p,
                  top_k=0 if self.top_k < 0 or self.top_k >= 1 << 30 else self.top_k,
                  max_tokens=self.max_new_tokens, min_tokens=self.min_new_tokens, stop=self.stop,
                  stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                  skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.no_stop_trim,
                  seed=self.sampling_seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs, output_kind=kind,
                  return_routed_experts=routed_experts)
        try:
            return make_sampling_params(kw)
        except InvalidRequestError as e:
            raise APIError(400, str(e), f"sampling_params.{e.param}" if e.param else "sampling_params") from e


class SGLangGenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    lora_path: str | None = None  # a loaded LoRA adapter's name
    cache_salt: str | None = Field(default=None, min_length=1)
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None  # (SGLang's older name)
    image_data: Any = None
    input_embeds: Any = None
    session_params: Any = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # the first position whose routing is returned (at most the prompt's length)
    return_hidden_states: bool = False


def is_sglang_generate(data: dict) -> bool:
    """Whether a /generate body is SGLang's (its prompt fields) rather than ours."""
    return "input_ids" in data or "text" in data


async def generate(request: Request, data: dict):
    """SGLang's /generate (our /generate hands such bodies here)."""
    check_wire_values(data)
    body: SGLangGenerateRequest = parse(SGLangGenerateRequest, data)
    state = get_state(request)
    state.check_can_generate()
    for name in ("image_data", "input_embeds", "session_params"):
        if getattr(body, name) is not None:
            raise APIError(400, f"{name} is not supported in SGLang's /generate here" + (
                " (sessions: our /generate with prompt_token_ids and session_params)" if name == "session_params"
                else ""), name)
    if body.return_hidden_states:
        raise APIError(400, "return_hidden_states is not supported by this engine", "return_hidden_states")
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of 'text' and 'input_ids'", "input_ids")
    field = "text" if body.text is not None else "input_ids"
    value = body.text if body.text is not None else body.input_ids
    batch = isinstance(value, list) and bool(value) and not isinstance(value[0], int)
    prompts = list(value) if batch else [value]
    if not prompts:
        raise APIError(400, f"{field} is an empty batch", field)
    scoring = body.return_logprob and body.logprob_start_len >= 0
    top = body.top_logprobs_num if body.return_logprob else None
    kind = RequestOutputKind.CUMULATIVE if body.stream else RequestOutputKind.FINAL_ONLY
    params = body.sampling_params.to_engine(top, top if scoring else None, kind, body.return_routed_experts)
    if body.return_routed_experts:
        try:
            state.engine.processor.check_routed_experts(params)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "return_routed_experts") from e
    ids = await tokenize_prompts(state, prompts, field, batch, params, "sampling_params.")
    if body.return_routed_experts:
        shortest = min(len(p) for p in ids)
        if not 0 <= body.routed_experts_start_len <= shortest:
            raise APIError(400, f"routed_experts_start_len must lie in [0, {shortest}] (the prompt's length), "
                                f"got {body.routed_experts_start_len}", "routed_experts_start_len")
    lora = state.resolve_model(body.lora_path) if body.lora_path else None
    rank = body.routed_dp_rank if body.routed_dp_rank is not None else body.data_parallel_rank
    route = Route(data_parallel_rank=rank) if rank is not None else None
    rids = _rids(state, body.rid, len(ids), batch)
    gens = [state.generate(p, params, rid, field, lora, body.cache_salt, route) for p, rid in zip(ids, rids)]
    arrival = time.monotonic()
    if body.stream:
        return await _streamed(request, state, body, gens, arrival)
    outs = await until_disconnect(request, gather_all(final_output(g) for g in gens))
    version = await call(state.engine.get_weight_version())
    results = [_result(state, body, o, c, arrival, version) for o in outs for c in o.outputs]
    return results if batch or params.n > 1 else results[0]


def _rids(state: ServerState, rid, num: int, batch: bool) -> list[str]:
    if isinstance(rid, list):
        if len(rid) != num:
            raise APIError(400, f"rid has {len(rid)} ids for {num} prompts", "rid")
        return [state.new_request_id(r, "sgl") for r in rid]
    base = state.new_request_id(rid, "sgl")
    return [f"{base}-{i}" for i in range(num)] if batch else [base]


def _finish_reason(state: ServerState, c: CompletionOutput) -> dict | None:
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "stop":
        matched = c.stop_reason if c.stop_reason is not None else state.engine.processor.eos_token_id
        return {"type": "stop", "matched": matched}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": "aborted", "status_code": None, "err_type": None}
    if c.finish_reason == "stale":  # SGLang's frameworks know stop / length / abort: ended early with its tokens
        return {"type": "abort", "message": "stale: the weights moved past its max_weight_staleness",
                "status_code": None, "err_type": "stale"}
    return None


def _triples(state: ServerState, body: SGLangGenerateRequest, ids: list[int], logprobs: list) -> list[list]:
    decode = state.engine.tokenizer.decode
    return [[lp, t, decode([t]) if body.return_text_in_logprobs else None] for t, lp in zip(ids, logprobs)]


def _top(state, body, steps: list) -> list:
    """SGLang's top logprobs: per position, [logprob, id, text] triples, best first (None where
    there is nothing, as at a prompt's first token)."""
    out = []
    for step in steps:
        ranked = sorted((step or {}).items(), key=lambda x: -x[1])
        out.append(None if step is None else _triples(state, body, [t for t, _ in ranked], [lp for _, lp in ranked]))
    return out


def _result(state: ServerState, body: SGLangGenerateRequest, out: RequestOutput, c: CompletionOutput,
            arrival: float, version: int) -> dict:
    meta = {"id": out.request_id if len(out.outputs) == 1 else f"{out.request_id}-{c.index}",
            "finish_reason": _finish_reason(state, c), "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(c.token_ids), "cached_tokens": out.num_cached_tokens,
            "weight_version": str(c.weight_versions[-1] if c.weight_versions else version)}
    if body.return_logprob:
        meta["output_token_logprobs"] = _triples(state, body, c.token_ids, c.logprobs or [])
        if c.top_logprobs is not None and body.top_logprobs_num:
            meta["output_top_logprobs"] = _top(state, body, c.top_logprobs)
        if out.prompt_logprobs is not None:
            start = body.logprob_start_len
            meta["input_token_logprobs"] = _triples(state, body, out.prompt_token_ids[start:],
                                                    [None, *out.prompt_logprobs[start + 1:]])
            if out.prompt_top_logprobs is not None and body.top_logprobs_num:
                meta["input_top_logprobs"] = _top(state, body, out.prompt_top_logprobs[start:])
    if body.return_routed_experts and c.routed_experts is not None and c.finish_reason is not None:
        # SGLang's: base64 of int32, flattened (positions [routed_experts_start_len, prompt + output - 1),
        # num_layers, top_k); sent with the sequence's end, as SGLang does
        rows = c.routed_experts[body.routed_experts_start_len:]
        meta["routed_experts"] = base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")
    if out.finished:
        meta["e2e_latency"] = time.monotonic() - arrival
    return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}


async def _streamed(request: Request, state: ServerState, body: SGLangGenerateRequest, gens: list, arrival: float):
    """SGLang's stream: SSE events with the cumulative text, ids and logprobs so far, each with
    its "index" (prompt-major over n), then `data: [DONE]`."""
    firsts = await prime(gens, request)
    version = await call(state.engine.get_weight_version())

    async def events():
        async for i, item in merge(gens, firsts):
            if isinstance(item, BaseException):
                err = item if isinstance(item, APIError) else APIError(500, str(item))
                yield sse({"error": {"message": err.message, "type": err.type, "code": err.status}})
                continue
            for c in item.outputs:
                yield sse(dict(_result(state, body, item, c, arrival, version), index=i * len(item.outputs) + c.index))
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- weights --------------------------------------------------------------------------------------
class InitWeightsUpdateGroupBody(_Body):
    master_address: HostAddress
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"
    timeout_s: float = Field(default=300.0, gt=0, le=3600)  # (ours) how long to wait for the trainer


class DestroyWeightsUpdateGroupBody(_Body):
    group_name: str = DEFAULT_GROUP


class UpdateWeightsFromDistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    load_format: str | None = None


class SGLangUpdateFromDiskBody(_Body):
    model_path: str
    load_format: str | None = None
    weight_version: str | int | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightsFromTensorBody(_Body):
    serialized_named_tensors: list[Any]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None


def _failed(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


def _int_version(v) -> int | None:
    """SGLang's versions are strings ("3" in slime); ours are integers."""
    if v is None or isinstance(v, int):
        return v
    if v.strip().lstrip("-").isdigit():
        return int(v)
    raise APIError(400, f"weight_version must be an integer (as a string is fine), got {v!r}", "weight_version")


async def _weight_call(coro) -> dict | JSONResponse:
    """An engine weight call, its failure as SGLang's {"success": false, "message"}."""
    try:
        return await call(coro)
    except APIError as e:
        return _failed(e.message, 400 if e.status < 500 else e.status)


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitWeightsUpdateGroupBody, request: Request):
    state = get_state(request)
    workers = len(await call(state.engine.collective_rpc("get_rank")))
    if body.rank_offset < 1 or body.world_size < body.rank_offset + workers:
        return _failed(f"this server has {workers} worker rank(s): it needs rank_offset >= 1 (the trainer is rank 0) "
                       f"and world_size >= rank_offset + {workers}, got rank_offset {body.rank_offset} and "
                       f"world_size {body.world_size}")
    on_gpu = str(state.engine.config.device).startswith("cuda")
    if body.backend not in ("gloo", "nccl") or (body.backend == "nccl" and not on_gpu):
        return _failed(f"backend {body.backend!r} is not available: this engine runs on {state.engine.config.device} "
                       f"(use {'nccl' if on_gpu else 'gloo'})")
    async with state.control_lock:
        result = await _weight_call(state.engine.init_weight_transfer(
            body.master_address, body.master_port, body.world_size, body.backend, body.timeout_s,
            rank_offset=body.rank_offset, group_name=body.group_name))
    if isinstance(result, JSONResponse):
        return result
    state.weight_group_name = body.group_name
    log(f"joined weight group {body.group_name!r} at {body.master_address}:{body.master_port} as ranks {result}")
    return {"success": True, "message": f"Joined weight group {body.group_name!r} as ranks {result}."}


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupBody, request: Request):
    state = get_state(request)
    if state.weight_group_name != body.group_name:
        return _failed("The group to be destroyed does not exist.")
    await call(state.engine.close_weight_transfer())
    state.weight_group_name = None
    return {"success": True, "message": f"Group {body.group_name!r} destroyed."}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody, request: Request):
    state = get_state(request)
    if state.weight_group_name != body.group_name:
        return _failed(f"no weight group {body.group_name!r}: POST /init_weights_update_group first")
    if body.load_format not in (None, "flattened_bucket"):
        return _failed(f"load_format {body.load_format!r} is not supported (None or 'flattened_bucket')")
    args = [body.names, body.dtypes, body.shapes, body.load_format == "flattened_bucket"]
    return await _paused_update(state, "named", args, _int_version(body.weight_version), body.abort_all_requests,
                                "distributed")


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: UpdateWeightsFromTensorBody, request: Request):
    return _failed("update_weights_from_tensor carries CUDA IPC handles pickled for a colocated SGLang server; this "
                   "server takes /update_weights_from_distributed, /update_weights_from_disk, or our "
                   "/update_weights_from_ipc (rollout.RolloutClient.push_weights_shared) instead")


async def update_weights_from_disk(request: Request, data: dict):
    """SGLang's /update_weights_from_disk (our route of that name hands such bodies here)."""
    body: SGLangUpdateFromDiskBody = parse(SGLangUpdateFromDiskBody, data)
    state = get_state(request)
    result = await _paused_update(state, "disk", [body.model_path], _int_version(body.weight_version),
                                  body.abort_all_requests, "disk")
    if isinstance(result, dict):
        result["num_paused_requests"] = 0
    return result


async def _paused_update(state: ServerState, source: str, args: list, version: int | None, abort_all: bool,
                         label: str) -> dict | JSONResponse:
    """Run one update as SGLang does: it waits for in-flight requests unless generation is paused
    or `abort_all_requests`; here requests in flight go on generating while the bytes arrive and
    are held in place (pause keep) for the swap only (AsyncLLM.update_weights_from's pause), then
    go on; `abort_all_requests` ends them instead."""
    t0 = time.monotonic()
    trace = UpdateTrace()
    async with state.control_lock:
        if abort_all and await call(state.engine.is_paused()):
            await call(state.abort_all_in_flight())
        try:
            result = await _weight_call(state.engine.update_weights_from(
                source, args, version, trace=trace, pause={"mode": "abort" if abort_all else "keep"}))
        finally:
            if trace.paused_here:
                await call(state.engine.resume_generation())
    if isinstance(result, JSONResponse):
        return result
    seconds = time.monotonic() - t0
    state.metrics.observe_push(label, seconds)
    version = result.get("weight_version")
    log(f"weights version {version} in place (SGLang's {label} update, {seconds:.2f} s)")
    return {"success": True, "message": f"Succeeded to update model weights. Weight version updated to {version}."}


# ---- generation control -------------------------------------------------------------------------
class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortRequestBody(_Body):
    rid: str | None = None
    abort_all: bool = False


class MemoryTagsBody(_Body):
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseGenerationBody | None = None):
    """abort: in-flight requests end (finish_reason abort); in_place: they wait in place;
    retract: they wait and recompute their KV under the weights pushed meanwhile. New requests
    wait for /continue_generation in every mode."""
    state = get_state(request)
    mode, recompute = PAUSE_MODES[(body or PauseGenerationBody()).mode]
    async with state.control_lock:
        if not await call(state.engine.is_paused()):
            await call(state.engine.pause_generation(mode=mode, clear_cache=False, recompute_kv=recompute))
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request):
    state = get_state(request)
    async with state.control_lock:
        if await call(state.engine.is_paused()):
            await call(state.engine.resume_generation())
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    await call(get_state(request).engine.reset_prefix_cache())
    return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                             "waiting requests, the operation will not be performed.)\n")


@router.post("/abort_request")
async def abort_request(body: AbortRequestBody, request: Request):
    """SGLang matches `rid` as a prefix of request ids (a batch's prompts share it)."""
    state = get_state(request)
    if body.abort_all:
        await call(state.abort_all_in_flight())
    elif body.rid:
        ids = [rid for rid in list(state.in_flight) if rid.startswith(body.rid)]
        if ids:
            await call(state.engine.abort(ids))
    return PlainTextResponse("")


@router.get("/v1/loads")
async def loads(request: Request):
    """Per replica: running and waiting requests, KV usage and the prefix hit rate (slime polls
    num_running_reqs + num_waiting_reqs to see a server drained)."""
    state = get_state(request)
    stats = await call(state.engine.get_stats())
    per = stats.get("replicas") or [stats]
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "loads": [{"dp_rank": i, "num_running_reqs": s["num_running"], "num_waiting_reqs": s["num_waiting"],
                       "num_total_reqs": s["num_running"] + s["num_waiting"],
                       "max_running_requests": state.engine.config.max_num_seqs,
                       "token_usage": s.get("kv_usage", 0.0), "cache_hit_rate": s.get("prefix_hit_rate", 0.0)}
                      for i, s in enumerate(per)]}


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: MemoryTagsBody | None = None):
    """Sleep level 1 (the weights kept off the device, the KV cache dropped): all SGLang's tags
    at once, as a subset cannot sleep alone here."""
    state = get_state(request)
    async with state.control_lock:
        await call(state.engine.sleep(1, "abort"))
    return JSONResponse(None)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: MemoryTagsBody | None = None):
    tags = sorted({t for t in (body.tags if body and body.tags else ["weights", "kv_cache"]) if t != "cuda_graph"})
    state = get_state(request)
    async with state.control_lock:
        await call(state.engine.wake_up(tags or None))
    return JSONResponse(None)


# ---- info ----------------------------------------------------------------------------------------
@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return {"weight_version": str(await call(get_state(request).engine.get_weight_version()))}


@router.get("/health_generate")
async def health_generate(request: Request):
    """Health by generating one token (SGLang's: 503 when none comes within 20 s)."""
    state = get_state(request)
    params = make_sampling_params({"max_tokens": 1, "temperature": 0.0, "output_kind": RequestOutputKind.FINAL_ONLY})
    rid = state.new_request_id(None, "health")
    try:
        await wait_within(final_output(state.generate([state.engine.processor.eos_token_id or 0], params, rid)),
                          timeout=20.0)
    except Exception as e:  # noqa: BLE001 - any failure is "not healthy"
        return JSONResponse({"error": {"message": f"the engine did not generate: {e or type(e).__name__}"}},
                            status_code=503)
    return PlainTextResponse("")


@router.get("/get_server_info")
async def get_server_info(request: Request):
    """The keys slime compares across its servers (tp_size, dp_size, ...) and a few more."""
    state = get_state(request)
    cfg = state.engine.config
    return {"model_path": state.model_path, "served_model_name": state.model_name, "tp_size": cfg.tensor_parallel_size,
            "dp_size": cfg.data_parallel_size, "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0,
            "base_gpu_id": 0, "gpu_id_step": 1, "enable_memory_saver": True, "dtype": cfg.dtype,
            "context_length": state.engine.max_model_len, "max_running_requests": cfg.max_num_seqs,
            "weight_version": str(await call(state.engine.get_weight_version()))}


@router.get("/get_model_info")
async def get_model_info(request: Request):
    state = get_state(request)
    return {"model_path": state.model_path, "served_model_name": state.model_name, "tokenizer_path": state.model_path,
            "is_generation": True, "weight_version": str(await call(state.engine.get_weight_version())),
            "architectures": [state.engine.config.model_config.architecture]}


register("/generate", is_sglang_generate, generate, SGLangGenerateRequest)
register("/update_weights_from_disk", lambda data: "model_path" in data, update_weights_from_disk,
         SGLangUpdateFromDiskBody)
