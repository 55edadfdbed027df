"""RL control routes, with vLLM's names and parameters (query parameters where vLLM uses them):

    POST /pause?mode=abort|wait|keep&clear_cache=true&timeout_s=t
                                                         -> {"status": "paused", "aborted": n, "kept": n}
         (timeout_s: the pause lifts itself after t seconds unless resumed: a trainer that dies
          while generation is paused does not hang the rollouts; recompute_kv=true with keep:
          weights pushed during the pause make the frozen requests recompute their KV)
    POST /resume                                         -> {"status": "resumed"}
    GET  /is_paused                                      -> {"is_paused": bool}
    POST /sleep?level=1|2&mode=abort|wait|keep           -> {"status": "sleeping", "level": n}
    POST /wake_up?tags=weights&tags=kv_cache             -> {"status": "awake"|"sleeping"}
    GET  /is_sleeping                                    -> {"is_sleeping": bool}
    POST /reset_prefix_cache, /reset_encoder_cache, /reset_mm_cache -> {"success": true}
    POST /v1/load_lora_adapter {"lora_name", "lora_path"} -> text (vLLM's); requests name it as `model`
         (400 for a name the served model answers to); it serves whatever the residency: past
         --max-loras the engine reloads it when a request needs it (engine/worker/lora.py)
    POST /v1/unload_lora_adapter {"lora_name"}          -> text
    POST /start_profile                                  -> {"status": "profiling"}
    POST /stop_profile                                   -> {"status": "stopped", "traces": [paths]}
         (torch-profiler traces of the engine core; 409 unless served with --profiler-dir)
    POST /abort_requests {"request_ids": [...]}          -> {"status": "aborted", "aborted": n}
         (no ids, or "all": true: every request in flight; a batch request's id aborts its prompts)
         with "wait": true (ours; "timeout_s": 60, "return_prompt_token_ids": false) it answers once
         every aborted request has ended, with what each caller received:
         -> {"status": "aborted"|"timed_out", "aborted": n, "requests": [{"request_id", "index",
             "token_ids", "logprobs", "weight_versions", "finish_reason", "text", ...}, one per sample],
             "pending": [ids not ended in time], "already_finished": [ids], "not_found": [ids]}
         (rollout/api/abort_manifest.py)
    POST /collective_rpc {"method", "args", "kwargs", "timeout"} -> {"results": [one per worker]}
         (registered methods only: ServerConfig.rpc_methods; arguments are JSON values)
    POST /apply_model {"fn": "package.module:function"}  -> {"results": [fn(model), one per worker]}
         (registered functions only: --apply-model-fn; tensors in a result come back as lists)
    POST /scale {"data_parallel_size", "drain_timeout_s"} -> {"data_parallel_size", "added", "removed"}
         (and vLLM's POST /scale_elastic_ep {"new_data_parallel_size", "drain_timeout"})
    GET  /get_world_size?include_dp=                     -> {"world_size": worker ranks, of all replicas or one}
    GET  /server_info?config_format=json                 -> model, dtype, device, limits, state, and vLLM's
                                                            `vllm_config` (the parts TRL reads); `shm_host`:
                                                            weight_sync.host_key() when every engine process
                                                            runs on this machine (a trainer with the same
                                                            key pushes through shared memory), else null;
                                                            `replica_hosts`: {data_parallel_rank: its host
                                                            key, null if it cannot answer} (a trainer
                                                            beside some replicas pushes to those through
                                                            shared memory, over the group to the others)

Like vLLM's /sleep, a sleep while generating first pauses with `mode`; the wake-up that
leaves nothing asleep resumes what that sleep paused. The engine core owns the pause and sleep
state (every route asks it); the routes that change it run one at a time
(`ServerState.control_lock`).
"""
import time
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse

from rollout.api.abort_manifest import abort_with_manifest, expand_ids
from rollout.api.errors import APIError, engine_error
from rollout.api.protocol import (AbortRequestsBody, ApplyModelBody, CollectiveRPCBody, LoadLoRARequest,
                                  ResetPrefixCacheBody, ScaleBody, ScaleElasticEPBody, UnloadLoRARequest)
from rollout.api.state import get_state
from rollout.log import log
from weight_sync import host_key

router = APIRouter(tags=["admin"])
info_router = APIRouter(tags=["info"])
PauseMode = Literal["abort", "wait", "keep"]


async def call(coro, param: str | None = None):
    """Await an engine call, turning its exceptions into APIErrors."""
    try:
        return await coro
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e, param) from e


@router.post("/pause")
async def pause(request: Request, mode: PauseMode = Query("abort"), clear_cache: bool = Query(True),
                timeout_s: float | None = Query(None, gt=0), recompute_kv: bool = Query(False)):
    state = get_state(request)
    t0 = time.monotonic()
    async with state.control_lock:
        result = await call(state.engine.pause_generation(mode=mode, clear_cache=clear_cache, timeout_s=timeout_s,
                                                          recompute_kv=recompute_kv), "mode")
    state.metrics.pause_call_seconds.observe(time.monotonic() - t0)
    log(f"generation paused (mode {mode}): {result['kept']} request(s) kept, {result['aborted']} aborted"
        + (f"; it lifts itself after {timeout_s:g} s" if timeout_s else ""))
    return {"status": "paused", "mode": mode, "aborted": result["aborted"], "kept": result["kept"]}


@router.post("/resume")
async def resume(request: Request):
    state = get_state(request)
    async with state.control_lock:
        result = await call(state.engine.resume_generation())
    state.metrics.observe_pause(result["paused_seconds"])
    log(f"generation resumed after {result['paused_seconds'] or 0:.2f} s paused")
    return {"status": "resumed", "paused_seconds": result["paused_seconds"]}


@info_router.get("/is_paused")
async def is_paused(request: Request):
    return {"is_paused": await call(get_state(request).engine.is_paused())}


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1), mode: PauseMode = Query("abort")):
    state = get_state(request)
    if level not in (1, 2):
        raise APIError(400, f"level must be 1 or 2, got {level}", "level")
    async with state.control_lock:
        await call(state.engine.sleep(level, mode), "level")
    log(f"sleeping (level {level}, mode {mode})")
    return {"status": "sleeping", "level": level}


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)):
    state = get_state(request)
    bad = [t for t in tags or [] if t not in ("weights", "kv_cache")]
    if bad:
        raise APIError(400, f"tags must be 'weights' and/or 'kv_cache', got {bad}", "tags")
    async with state.control_lock:
        result = await call(state.engine.wake_up(tags or None), "tags")
    state.metrics.observe_pause(result["paused_seconds"])
    log(f"woke up {' and '.join(tags) if tags else 'everything'}: " + ("still sleeping" if result["is_sleeping"]
                                                                        else "awake"))
    return {"status": "sleeping" if result["is_sleeping"] else "awake"}


@info_router.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": bool(await call(get_state(request).engine.is_sleeping()))}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, reset_running_requests: bool = Query(False),
                             reset_external: bool = Query(False), body: ResetPrefixCacheBody | None = None):
    """vLLM's flags come as query parameters, or as a JSON body (SkyRL's RemoteInferenceClient
    sends {"reset_running_requests": bool}). Both are accepted and change nothing: the reset
    forgets every cached block, running requests' too (they keep their KV, nobody finds it), and
    there is no external (connector) cache."""
    return {"success": bool(await call(get_state(request).engine.reset_prefix_cache()))}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request):
    """Load a PEFT LoRA adapter under a name that requests then use as their `model` (the server
    must run with --enable-lora). With several API servers, every one serves it by that name."""
    state = get_state(request)
    if body.lora_name in state.loras and not body.load_inplace:
        raise APIError(400, f"the LoRA adapter {body.lora_name!r} is already loaded", "lora_name")
    lora = state.new_lora(body.lora_name, body.lora_path)
    await call(state.engine.add_lora(lora), "lora_path")
    try:
        old = state.record_lora(lora, replace=body.load_inplace)
    except APIError:  # loaded under that name through another API server meanwhile
        await call(state.engine.remove_lora(lora.lora_int_id), "lora_name")
        raise
    if old is not None:  # load_inplace: the old id goes once the new one serves
        await call(state.engine.remove_lora(old.lora_int_id), "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request):
    state = get_state(request)
    lora = state.loras.get(body.lora_name)
    if lora is None:
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} is not loaded", "lora_name")
    await call(state.engine.remove_lora(lora.lora_int_id), "lora_name")
    state.forget_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.post("/start_profile")
async def start_profile(request: Request):
    """A torch-profiler trace of the engine core(s) until /stop_profile (needs --profiler-dir)."""
    await call(get_state(request).engine.start_profile())
    return {"status": "profiling"}


@router.post("/stop_profile")
async def stop_profile(request: Request):
    return {"status": "stopped", "traces": await call(get_state(request).engine.stop_profile())}


@router.post("/reset_encoder_cache")
async def reset_encoder_cache(request: Request):
    return {"success": bool(await call(get_state(request).engine.reset_encoder_cache()))}


@router.post("/reset_mm_cache")
async def reset_mm_cache(request: Request):
    return {"success": bool(await call(get_state(request).engine.reset_mm_cache()))}


@router.post("/abort_requests")
async def abort_requests(request: Request, body: AbortRequestsBody | None = None):
    state = get_state(request)
    body = body or AbortRequestsBody()
    wanted = body.request_ids or None  # (none: every request in flight)
    if body.wait:
        return await call(abort_with_manifest(state, wanted, body.timeout_s, body.return_prompt_token_ids),
                          "request_ids")
    if wanted is None:
        return {"status": "aborted", "aborted": await call(state.abort_all_in_flight())}
    ids, _ = expand_ids(state.in_flight, wanted)  # a batch request's prompts run as "<id>-<i>": its id aborts them
    if ids:
        await call(state.engine.abort(ids))
    return {"status": "aborted", "aborted": len(ids)}


@router.post("/collective_rpc")
async def collective_rpc(body: CollectiveRPCBody, request: Request):
    state = get_state(request)
    allowed = state.config.rpc_methods
    if body.method not in allowed:
        raise APIError(403, f"method {body.method!r} is not registered for /collective_rpc (registered: "
                            f"{sorted(allowed)}; add more with --collective-rpc-method)", "method")
    results = await call(state.engine.collective_rpc(body.method, body.args, body.kwargs, timeout=body.timeout),
                         "args")
    return {"results": [r if r is None or isinstance(r, (dict, list, str, int, float, bool)) else str(r)
                        for r in results]}


@router.post("/apply_model")
async def apply_model(body: ApplyModelBody, request: Request):
    """AsyncLLM.apply_model for the functions the server was started with (--apply-model-fn):
    a caller names one, never sends code."""
    state = get_state(request)
    if not state.config.allows_apply_model(body.fn):
        raise APIError(403, f"function {body.fn!r} is not registered for /apply_model (registered: "
                            f"{sorted(state.config.apply_model_fns)}; add more with --apply-model-fn)", "fn")
    return {"results": [_json_value(r) for r in await call(state.engine.apply_model(body.fn), "fn")]}


def _json_value(value):
    """A worker's result as JSON: tensors as nested lists, other objects by their str()."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if hasattr(value, "tolist"):  # a tensor (or a numpy array)
        return value.tolist()
    return str(value)


@router.post("/scale")
async def scale(body: ScaleBody, request: Request):
    """Grow or shrink the data-parallel replicas (AsyncLLM.scale); a trainer re-runs
    init_weight_transfer afterwards (the world size changed)."""
    state = get_state(request)
    async with state.control_lock:
        return await call(state.engine.scale(body.data_parallel_size, body.drain_timeout_s), "data_parallel_size")


@router.post("/scale_elastic_ep")
async def scale_elastic_ep(body: ScaleElasticEPBody, request: Request):
    """vLLM's name and body for /scale."""
    state = get_state(request)
    async with state.control_lock:
        return await call(state.engine.scale(body.new_data_parallel_size, body.drain_timeout),
                          "new_data_parallel_size")


@info_router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = Query(True)):
    state = get_state(request)
    if not include_dp:  # (vLLM's: the ranks of one replica)
        return {"world_size": state.engine.config.tensor_parallel_size}
    return {"world_size": len(await call(state.engine.collective_rpc("get_rank")))}


def _vllm_config(state) -> dict:
    """The part of vLLM's `vllm_config` that trainers read (TRL 1.16's VLLMClient: init_communicator
    needs `weight_transfer_config`, GRPO warns unless `model_config.logprobs_mode` is
    "processed_logprobs", which our default logprobs are)."""
    cfg = state.engine.config
    return {"model_config": {"model": state.model_path, "served_model_name": state.model_name, "dtype": cfg.dtype,
                             "max_model_len": state.engine.max_model_len, "logprobs_mode": "processed_logprobs"},
            "parallel_config": {"tensor_parallel_size": cfg.tensor_parallel_size,
                                "data_parallel_size": cfg.data_parallel_size},
            "weight_transfer_config": {"backend": "nccl" if cfg.device.startswith("cuda") else "gloo"}}


@info_router.get("/server_info")
async def server_info(request: Request, config_format: Literal["json"] = Query("json")):
    """Ours, plus vLLM's `vllm_config` (as `?config_format=json` asks vLLM for it)."""
    state = get_state(request)
    cfg = state.engine.config
    return {"vllm_config": _vllm_config(state),
            "model": state.model_name, "model_path": state.model_path, "dtype": cfg.dtype, "device": cfg.device,
            "max_model_len": state.engine.max_model_len, "max_num_seqs": cfg.max_num_seqs,
            "weight_version": await call(state.engine.get_weight_version()),
            "is_paused": await call(state.engine.is_paused()), "is_sleeping": await call(state.engine.is_sleeping()),
            "requests_in_flight": len(state.in_flight), "data_parallel_size": cfg.data_parallel_size,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "api_server": state.config.api_server_index, "api_server_count": state.config.api_server_count,
            "supported_tasks": list(state.engine.get_supported_tasks()),
            "tracing": await state.engine.is_tracing_enabled(),
            **await _hosts(state)}


async def _hosts(state) -> dict:
    """{"shm_host": this machine's host key when every engine process runs here, "replica_hosts":
    each replica's}. Local processes are always here; a Ray actor where it reports this key (a
    local cluster: Ray may place replicas on other nodes, whose shared memory is not ours).
    Asked anew each time: replicas come and go (/scale)."""
    here, ranks = host_key(), state.engine.client.replica_ranks()
    if here is None or state.engine.config.data_parallel_backend == "mp":
        hosts = dict.fromkeys(ranks, here)
    else:
        try:
            keys = await state.engine.collective_rpc("host_key", timeout=10)
        except Exception:  # noqa: BLE001 - a replica that cannot answer now: the group is the safe way
            keys = []
        per = state.engine.config.tensor_parallel_size  # (one key per worker, replica after replica)
        if len(keys) != per * len(ranks):
            keys = [None] * per * len(ranks)
        hosts = {}
        for i, r in enumerate(ranks):  # a replica whose workers sit on different machines has no one host
            workers = set(keys[i * per:(i + 1) * per])
            hosts[r] = workers.pop() if len(workers) == 1 else None
    local = bool(hosts) and here is not None and all(k == here for k in hosts.values())
    return {"shm_host": here if local else None, "replica_hosts": {str(r): k for r, k in hosts.items()}}
