"""Weight routes. vLLM's four weight-transfer phases, same names and bodies:

    POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port", "world_size",
         "rank_offset": 1, "backend": "gloo"|"nccl" (ours; default by device), "timeout_s",
         "replicas" (ours: only these data-parallel replicas join; default all)}}
         -> the engine's workers join the trainer's group (blocks until every rank joined, so the
            trainer creates its rank-0 side concurrently)
    POST /start_weight_update {"is_checkpoint_format": true}   -> opens an update
    POST /update_weights {"update_info": {"names", "dtype_names", "shapes", "packed",
         "weight_version" (ours, optional)}}
         -> receives one push from the trainer's WeightSender (concurrent with it) and swaps it in
            atomically; the prefix and encoder caches are cleared
         (prime-rl's body {"weight_dir"} on the same route: an update from that folder,
          rollout/compat/vllm_rl.py)
    POST /finish_weight_update {"weight_version": v}   -> closes the update; v labels the weights
         (default: the previous version + 1 per /update_weights)

Ours: POST /update_weights_from_disk {"path", "version"}, POST /reload_weights {"version"} (the
start-up checkpoint: after sleep level 2, or to undo pushes), POST /update_weights_from_ipc
{"handles", "version"} (a trainer on the same machine: weight_sync.SharedWeights, CUDA IPC on a
shared GPU or shared memory on CPU; or the engine's own staging memory, leased by POST
/weights/spare {"holder"} and written by weight_sync.SpareWriter), POST /close_weight_transfer,
GET /weights/version (and vLLM's GET /weight_info), GET /weights/checksum (compare with
`weight_sync.weights_checksum` on the trainer's tensors to verify a push), POST /save_weights
{"path", "overwrite": false, "max_shard_bytes"} (the live weights, pushes included, as a Hugging
Face folder on the server's disk that transformers loads; 400 for a folder that exists and is
not empty unless overwrite, and nothing is written then).

Update the weights with generation paused (POST /pause) or idle: the engine refuses (409)
while requests run. Versions are integers here (vLLM's are strings): a non-integer one is a 400.

LoRA pushes (ours): `lora_name` in /update_weights' update_info, /update_weights_from_disk (a PEFT
folder) or /update_weights_from_ipc updates that adapter only (its tensors by PEFT name, a subset
is fine), atomically, under the adapter's own version (`version` / `weight_version`, default +1;
no start/finish phases); tokens generated with it carry it in `lora_versions`. The pushed adapter
stays resident (pinned) until /v1/unload_lora_adapter.
"""
import time
from pathlib import Path

import msgspec
from fastapi import APIRouter, Request, Response

from engine.errors import InvalidRequestError
from engine.process.utility import group_replicas
from rollout.api.cancel import until_disconnect
from rollout.api.control import call
from rollout.api.dispatch import alternate, json_object, one_of, parse
from rollout.api.errors import APIError
from rollout.api.protocol import (FinishWeightUpdateBody, InitWeightTransferBody, LeaseSpareBody, ReloadWeightsBody,
                                  SaveWeightsBody, StartWeightUpdateBody, UpdateFromDiskBody, UpdateFromIPCBody,
                                  UpdateWeightsBody)
from rollout.api.state import ServerState, WeightUpdate, get_state
from rollout.log import log

router = APIRouter(tags=["admin"])
info_router = APIRouter(tags=["info"])


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitWeightTransferBody, request: Request):
    state = get_state(request)
    info = body.init_info
    num_workers = len(await call(state.engine.collective_rpc("get_rank")))
    if info.replicas is not None:
        live = state.engine.client.replica_ranks()
        try:
            joining = group_replicas(live, info.replicas)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "init_info.replicas") from None
        num_workers = num_workers * len(joining) // len(live)
    # SkyRL gives each of its servers its own rank_offset in one group (1, 1 + workers, ...)
    if info.rank_offset < 1:
        raise APIError(400, "rank_offset must be at least 1 (the trainer is rank 0)", "init_info.rank_offset")
    if info.world_size < info.rank_offset + num_workers:
        raise APIError(400, f"world_size must be at least rank_offset + {num_workers} (this server's engine "
                            f"worker(s) take ranks {info.rank_offset}..{info.rank_offset + num_workers - 1}), got "
                            f"{info.world_size}", "init_info.world_size")
    on_gpu = str(state.engine.config.device).startswith("cuda")
    backend = info.backend or ("nccl" if on_gpu else "gloo")
    if backend == "nccl" and not on_gpu:
        raise APIError(400, "backend 'nccl' needs the engine on a CUDA device; this engine runs on "
                            f"{state.engine.config.device}: use 'gloo'", "init_info.backend")
    # The engine forms the group in a thread and goes on serving; a client that goes away
    # closes the group it was forming.
    try:
        ranks = await until_disconnect(request, call(state.engine.init_weight_transfer(
            info.master_address, info.master_port, info.world_size, backend, info.timeout_s,
            rank_offset=info.rank_offset, replicas=info.replicas), "init_info"))
    except APIError as e:
        if e.status == 499:
            await call(state.engine.close_weight_transfer())
        raise
    state.weight_group_name = None  # (it replaced a named group, if one was open)
    return {"message": "Weight transfer initialized", "ranks": ranks, "backend": backend}


@router.post("/start_weight_update")
async def start_weight_update(request: Request, body: StartWeightUpdateBody | None = None):
    state = get_state(request)
    # (kept by every API server alike: the trainer's next call may reach another one)
    state.weight_update = WeightUpdate(time.monotonic(), await call(state.engine.get_weight_version()))
    return {"message": "Weight update started"}


@router.post("/update_weights", openapi_extra=one_of(UpdateWeightsBody))
async def update_weights(request: Request):
    data = await json_object(request)
    answer = await alternate("/update_weights", request, data)  # prime-rl's body {weight_dir}
    if answer is not None:
        return answer
    body: UpdateWeightsBody = parse(UpdateWeightsBody, data)
    state = get_state(request)
    info = body.update_info
    if info.lora_name is not None:
        lora_id = await _loaded_lora(state, info.lora_name, "update_info.lora_name")
        return await _timed_update(state, "broadcast", state.engine.update_weights(info.weight_version, lora_id),
                                   "update_info", info.lora_name)
    async with state.control_lock:
        version_before = await call(state.engine.get_weight_version())
        result = await call(state.engine.update_weights(info.weight_version), "update_info")
    state.count_weight_update(version_before, result.get("weight_version"))
    return dict(result, message="Weights updated")


def _version(v) -> int | None:
    if v is None or isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    raise APIError(400, f"weight_version must be an integer, got {v!r}", "weight_version")


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, body: FinishWeightUpdateBody | None = None):
    state = get_state(request)
    upd = state.weight_update
    want = _version(body.weight_version if body else None)
    if upd is None or upd.num_updates == 0:
        raise APIError(409, "no weight update in progress: POST /start_weight_update and /update_weights first")
    current = await call(state.engine.get_weight_version())
    if want is not None and want != current:
        await call(state.engine.set_weight_version(want, upd.version_before), "weight_version")
        current = want
    state.weight_update = None
    seconds = time.monotonic() - upd.started
    state.metrics.observe_push("transfer", seconds)
    log(f"weights version {current} in place: {upd.num_updates} push(es) over the transfer group in {seconds:.2f} s")
    return {"message": "Weight update finished", "weight_version": current}


@router.post("/update_weights_from_disk", openapi_extra=one_of(UpdateFromDiskBody))
async def update_weights_from_disk(request: Request):
    data = await json_object(request)
    answer = await alternate("/update_weights_from_disk", request, data)  # SGLang's body {model_path, ...}
    if answer is not None:
        return answer
    body: UpdateFromDiskBody = parse(UpdateFromDiskBody, data)
    if not Path(body.path).is_dir():
        raise APIError(400, f"path {body.path!r} is not a folder on the server", "path")
    state = get_state(request)
    lora_id = await _loaded_lora(state, body.lora_name, "lora_name")
    return await _timed_update(state, "disk", state.engine.update_weights_from_disk(body.path, body.version, lora_id),
                               "path", body.lora_name)


@router.post("/reload_weights")
async def reload_weights(request: Request, body: ReloadWeightsBody | None = None):
    """The start-up checkpoint again (after sleep level 2, or to undo pushes)."""
    state = get_state(request)
    return await _timed_update(state, "disk", state.engine.reload_weights(body.version if body else None),
                               "version")


@router.post("/update_weights_from_ipc")
async def update_weights_from_ipc(body: UpdateFromIPCBody, request: Request):
    state = get_state(request)
    lora_id = await _loaded_lora(state, body.lora_name, "lora_name")
    return await _timed_update(state, "ipc", state.engine.update_weights_from_ipc(body.handles, body.version, lora_id),
                               "handles", body.lora_name)


async def _loaded_lora(state: ServerState, lora_name: str | None, param: str) -> int:
    """The engine id of a LoRA adapter this server knows (loaded into the engine if it was
    evicted: a push updates its resident weights); 0 for None (the model itself)."""
    if lora_name is None:
        return 0
    lora = state.loras.get(lora_name)
    if lora is None:
        raise APIError(404, f"the LoRA adapter {lora_name!r} is not loaded (POST /v1/load_lora_adapter first)", param)
    await call(state.engine.add_lora(lora), param)
    return lora.lora_int_id


async def _timed_update(state: ServerState, source: str, update, param: str, lora_name: str | None = None) -> dict:
    """Run one update (of the model, or of the LoRA adapter `lora_name`) under the control lock
    and record its duration."""
    t0 = time.monotonic()
    async with state.control_lock:
        result = await call(update, param)
    seconds = time.monotonic() - t0
    state.metrics.observe_push(f"lora_{source}" if lora_name else source, seconds)
    what = f"LoRA adapter {lora_name!r}" if lora_name else "weights"
    log(f"{what} version {result.get('weight_version')} in place (via {source}, {seconds:.2f} s)")
    if lora_name is not None:
        return dict(result, lora_name=lora_name, message=f"LoRA adapter {lora_name!r} updated")
    return dict(result, message="Weights updated")


@router.post("/save_weights")
async def save_weights(body: SaveWeightsBody, request: Request):
    """The live weights as a Hugging Face folder (AsyncLLM.save_weights); under the control lock,
    so no update lands while it is written."""
    state = get_state(request)
    limit = {} if body.max_shard_bytes is None else {"max_shard_bytes": body.max_shard_bytes}
    t0 = time.monotonic()
    async with state.control_lock:
        result = await call(state.engine.save_weights(body.path, body.overwrite, **limit), "path")
    log(f"weights version {result['weight_version']} saved to {result['path']} ({len(result['files'])} file(s), "
        f"{time.monotonic() - t0:.2f} s)")
    return dict(result, message="Weights saved")


@router.post("/weights/spare")
async def lease_weight_spare(body: LeaseSpareBody, request: Request):
    """Lend a trainer on this machine the memory the next update is staged in: it writes its
    tensors there itself (while generation goes on) and pushes {"kind": "spare", ...} handles
    (engine/worker/weight_buffers.py; the client's push_weights_shared does both). 400 where no
    spare is lent (CUDA), 409 while another trainer holds it. A replica of several
    tensor-parallel ranks lends one per rank ({"ranks": [leases]}), each written with that rank's
    slices of the tensors and pushed as {"kind": "spare", "ranks": [each one's handles]}. With
    several replicas each lends its own: {"replicas": [each one's lease, with its "replica"]},
    pushed as {"kind": "spare", "replicas": [each one's handles, with its "replica"]}; with
    "replicas": [ranks] only those lend (the ones on the trainer's machine). It waits for an update
    under way (the control routes' turn): an update staged but not yet live holds the spare."""
    state = get_state(request)
    async with state.control_lock:
        lease = await call(state.engine.lease_weight_spare(body.holder, body.layouts, body.replicas))
    # (encoded here: FastAPI's own encoder walking the default model's 272 entries cost 6-12 ms a push)
    return Response(msgspec.json.encode(lease), media_type="application/json")


@router.post("/close_weight_transfer")
async def close_weight_transfer(request: Request):
    state = get_state(request)
    await call(state.engine.close_weight_transfer())
    state.weight_group_name = None
    return {"message": "Weight transfer closed"}


@info_router.get("/weights/version")
async def weights_version(request: Request):
    """The model's version, and each resident LoRA adapter's (by served name)."""
    state = get_state(request)
    resident = set(await call(state.engine.list_loras())) if state.loras else set()
    return {"weight_version": await call(state.engine.get_weight_version()),
            "lora_versions": {name: await call(state.engine.get_weight_version(lora.lora_int_id))
                              for name, lora in state.loras.items() if lora.lora_int_id in resident}}


@info_router.get("/weight_info")
async def weight_info(request: Request):
    return {"weight_version": await call(get_state(request).engine.get_weight_version())}


@router.get("/weights/checksum")
async def weights_checksum(request: Request):
    state = get_state(request)
    checksum = await call(state.engine.weights_checksum())
    return {"checksum": checksum, "weight_version": await call(state.engine.get_weight_version())}
