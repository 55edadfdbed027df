"""SGLang's dialect (rollout/compat/sglang.py) as slime and AReaL drive it, on a real `rollout
serve` of a tiny random Llama. Neither framework installs on a CPU machine (slime is not on
PyPI and imports sglang.srt; areal 1.0.4 pins torch < 2.11), so these are contract tests that
reproduce their exact calls; each test names the file it follows:

- SGLang 0.5.23 (PyPI wheel): python/sglang/srt/entrypoints/http_server.py (routes),
  srt/managers/io_struct.py (bodies), srt/managers/tokenizer_manager.py (meta_info),
  srt/utils/common.py init_custom_process_group (the weight group),
  srt/model_executor/.../weight_updater.py (one broadcast per tensor, or a flattened bucket).
- slime (THUDM/slime): slime/backends/sglang_utils/sglang_engine.py (control calls),
  slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py (the trainer's
  pause -> flush_cache -> metadata call + per-tensor broadcasts -> continue_generation),
  slime/utils/distributed_utils.py init_process_group (SGLang's recipe, copied),
  slime/rollout/sglang_rollout.py (the /generate body and the meta_info keys it reads).
- AReaL (areal-project/AReaL): areal/engine/sglang_remote.py (generate, scoring with
  logprob_start_len, pause {"mode": ...}, update_weights_from_disk with abort_all_requests),
  areal/infra/platforms/cpu.py (gloo on a CPU-only trainer).
"""
import datetime
import json
import threading
import time

import httpx
import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from rollout.subprocess_server import served
from tests.engine.hf_reference import hf_greedy, hf_prompt_logprobs, load_hf
from tests.engine.perturb import hf_model_with, perturbed_state
from tests.rollout.conftest import tiny_model_folder
from weight_sync import weights_checksum
from weight_sync.group import find_free_port

PROMPT = [1, 300, 4000, 12, 7, 99, 1024]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny_sglang"), default_model_path)
    with served(folder, "--dtype", "float32", log_path=tmp_path_factory.mktemp("logs") / "serve.log") as s:
        s.model_folder = folder
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def sgl_generate(http, **body) -> dict | list:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # AReaL reads only JSON answers
    return r.json()


def test_generate_answers_sglang_shape_and_transformers_tokens(server, http):
    """slime's rollout body (sglang_rollout.py): input_ids, return_logprob, no_stop_trim, ..."""
    out = sgl_generate(http, input_ids=PROMPT, return_logprob=True, sampling_params=dict(
        GREEDY, top_p=1.0, top_k=-1, stop_token_ids=[], skip_special_tokens=False, no_stop_trim=True,
        spaces_between_special_tokens=False))
    meta = out["meta_info"]
    tokens, lps, _ = hf_greedy(load_hf(server.model_folder), [PROMPT], 8)[0]
    assert out["output_ids"] == tokens
    assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens  # slime: item[1] is the token
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert max(abs(a - b) for (a, _, _), b in zip(meta["output_token_logprobs"], lps)) < 1e-4
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 8
    assert meta["weight_version"] == http.get("/get_weight_version").json()["weight_version"]
    assert {"id", "cached_tokens", "e2e_latency"} <= set(meta)
    assert isinstance(out["text"], str)
    # the same request in our dialect gives the same tokens
    ours = http.post("/generate", json={"prompt_token_ids": PROMPT, "sampling_params": {
        "temperature": 0, "max_tokens": 8, "ignore_eos": True}}).json()
    assert ours["results"][0]["outputs"][0]["token_ids"] == tokens


def test_batch_n_and_text(http):
    """A batch of input_ids answers a list (prompt-major over n); text prompts too."""
    outs = sgl_generate(http, input_ids=[PROMPT, PROMPT[:4]], sampling_params=dict(GREEDY, max_new_tokens=3))
    assert isinstance(outs, list) and len(outs) == 2 and all(len(o["output_ids"]) == 3 for o in outs)
    outs = sgl_generate(http, text="The capital of France is", sampling_params={
        "max_new_tokens": 4, "temperature": 1.0, "n": 2, "sampling_seed": 3})
    assert isinstance(outs, list) and len(outs) == 2
    one = sgl_generate(http, text="Hello", sampling_params={"max_new_tokens": 2, "temperature": 0.0})
    assert isinstance(one, dict) and len(one["output_ids"]) <= 2


def test_stop_finish_reason_and_top_logprobs(http):
    first = sgl_generate(http, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    out = sgl_generate(http, input_ids=PROMPT, return_logprob=True, top_logprobs_num=2,
                       return_text_in_logprobs=True,
                       sampling_params={"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [first[2]]})
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": first[2]}
    assert out["output_ids"] == first[:3]
    top = meta["output_top_logprobs"]
    assert len(top) == 3 and all(len(step) == 2 and step[0][0] >= step[1][0] for step in top)
    assert top[0][0][1] == first[0] and isinstance(top[0][0][2], str)


def test_areal_scoring_call(server, http):
    """AReaL scores a target continuation: max_new_tokens 1, logprob_start_len = len - target - 1,
    reading input_token_logprobs[-target:] (entry 0 of the list has a null logprob)."""
    target = 3
    out = sgl_generate(http, input_ids=PROMPT, return_logprob=True, logprob_start_len=len(PROMPT) - target - 1,
                       top_logprobs_num=0, sampling_params={"max_new_tokens": 1, "temperature": 0})
    entries = out["meta_info"]["input_token_logprobs"]
    assert len(entries) == target + 1 and entries[0][0] is None
    assert [t for _, t, _ in entries] == PROMPT[-target - 1:]
    want = hf_prompt_logprobs(load_hf(server.model_folder), PROMPT)[-target:]
    assert max(abs(a - b) for (a, _, _), b in zip(entries[-target:], want)) < 1e-4


def test_stream_is_cumulative_then_done(http):
    with http.stream("POST", "/generate", json={"input_ids": PROMPT, "stream": True, "return_logprob": True,
                                                "sampling_params": GREEDY}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 8  # cumulative, as SGLang streams by default
    final = sgl_generate(http, input_ids=PROMPT, sampling_params=GREEDY)
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_bad_input_in_sglang_shape_and_nothing_lost(http):
    for body, param in (({"input_ids": PROMPT, "sampling_params": {"max_new_token": 3}}, "max_new_token"),
                        ({"input_ids": PROMPT, "text": "x"}, "input_ids"),
                        ({"input_ids": [], "sampling_params": GREEDY}, "input_ids"),
                        ({"input_ids": PROMPT, "sampling_params": {"regex": "a+"}}, "regex"),
                        ({"text": "x", "image_data": "data:image/png;base64,AA"}, "image_data")):
        r = http.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        assert param in r.json()["error"]["message"] + str(r.json()["error"].get("param")), r.text
    assert len(sgl_generate(http, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]) == 8


def test_control_routes(http):
    """slime's and AReaL's calls: health_generate, flush_cache (GET, as slime polls it),
    v1/loads (slime's drain poll), get_server_info (slime's external-engine check), pause
    modes, abort_request, memory release and resume."""
    assert http.get("/health_generate").status_code == 200
    for method in ("GET", "POST"):
        r = http.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed")
    loads = http.get("/v1/loads", params={"include": "core,disagg,queues"}).json()["loads"]
    assert loads[0]["num_running_reqs"] == 0 and loads[0]["num_waiting_reqs"] == 0
    info = http.get("/get_server_info").json()
    assert {"tp_size", "dp_size", "pp_size", "ep_size", "enable_memory_saver", "nnodes", "node_rank",
            "base_gpu_id", "gpu_id_step"} <= set(info) and info["tp_size"] == 1 and info["dp_size"] == 1
    assert http.get("/get_model_info").json()["is_generation"] is True
    before = sgl_generate(http, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    # release and resume (sleep and wake): the same outputs after
    assert http.post("/release_memory_occupation", json={}).json() is None
    assert http.get("/is_sleeping").json()["is_sleeping"] is True
    assert http.post("/resume_memory_occupation", json={"tags": None}).json() is None
    assert sgl_generate(http, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == before
    for mode in ("abort", "retract", "in_place"):
        assert http.post("/pause_generation", json={"mode": mode}).json()["status"] == "ok"
        assert http.get("/is_paused").json()["is_paused"] is True
        assert http.post("/continue_generation", json={}).json()["status"] == "ok"
    assert http.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
    # SGLang's /update_weight_version (vLLM's route name, SGLang's extra field): a relabel
    version = int(http.get("/get_weight_version").json()["weight_version"]) + 10
    r = http.post("/update_weight_version", json={"new_version": str(version), "abort_all_requests": True})
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["new_version"] == str(version)
    assert http.get("/get_weight_version").json()["weight_version"] == str(version)


def test_abort_all_returns_partial_outputs(http):
    """slime's abort(): abort_request {"abort_all": true}, then poll /v1/loads until empty; the
    aborted request answers with finish_reason abort and the tokens it had (held in place by a
    pause once it runs, so that it is still running when the abort comes)."""
    box = {}
    t = threading.Thread(target=lambda: box.update(out=sgl_generate(
        http, input_ids=PROMPT, rid="long-one", sampling_params={"max_new_tokens": 200, "temperature": 0,
                                                                "ignore_eos": True})))
    t.start()
    deadline = time.monotonic() + 30
    while not http.get("/v1/loads").json()["loads"][0]["num_running_reqs"]:
        assert time.monotonic() < deadline and t.is_alive(), box
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    t.join(60)
    assert http.post("/continue_generation", json={}).status_code == 200
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 200
    assert meta["id"] == "long-one"
    loads = http.get("/v1/loads").json()["loads"][0]
    assert loads["num_running_reqs"] + loads["num_waiting_reqs"] == 0


def init_custom_process_group(master_address: str, master_port: int, world_size: int, group_name: str):
    """The trainer's rank 0, as slime/utils/distributed_utils.py init_process_group (SGLang's
    init_custom_process_group) forms it, with AReaL's CPU backend (gloo)."""
    timeout = datetime.timedelta(seconds=60)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def push(http, pg, tensors: dict, group: str, **extra) -> httpx.Response:
    """One slime bucket: the metadata call in flight, then dist.broadcast(src=0) per tensor in
    `names` order (or one flattened uint8 buffer), then the call's answer."""
    box = {}
    body = {"names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()], "group_name": group, "flush_cache": False, **extra}
    call = threading.Thread(target=lambda: box.update(r=http.post("/update_weights_from_distributed", json=body)))
    call.start()
    if extra.get("load_format") == "flattened_bucket":
        dist.broadcast(torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()]), src=0,
                       group=pg)
    else:
        handles = [dist.broadcast(t.contiguous(), src=0, group=pg, async_op=True) for t in tensors.values()]
        for h in handles:
            h.wait()
    call.join(120)
    return box["r"]


def test_slime_weight_cycle_over_gloo(server, http):
    """init group -> generate -> pause -> flush_cache -> update_weights_from_distributed (per-tensor,
    then a flattened bucket) -> continue: the outputs equal transformers on the new weights and
    carry the new version; a wrong shape is received whole, refused, and changes nothing."""
    group = "slime-pp_0"
    port = find_free_port()
    box = {}
    join = threading.Thread(target=lambda: box.update(r=http.post("/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
        "group_name": group, "backend": "gloo", "pp_rank": 0})))  # (AReaL's str port and extra key)
    join.start()
    pg = init_custom_process_group("127.0.0.1", port, 2, group)
    join.join(60)
    assert box["r"].status_code == 200 and box["r"].json()["success"] is True, box["r"].text
    try:
        state = perturbed_state(server.model_folder, seed=1)
        version = int(http.get("/get_weight_version").json()["weight_version"]) + 1
        assert http.post("/pause_generation", json={}).status_code == 200
        assert http.get("/flush_cache").status_code == 200
        half = len(state) // 2
        names = sorted(state)
        r = push(http, pg, {n: state[n].to(torch.bfloat16) for n in names[:half]}, group,
                 weight_version=str(version))
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        r = push(http, pg, {n: state[n] for n in names[half:]}, group, weight_version=str(version + 1),
                 load_format="flattened_bucket")
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert http.post("/continue_generation", json={}).status_code == 200
        pushed = {n: state[n].to(torch.bfloat16).float() if i < half else state[n] for i, n in enumerate(names)}
        out = sgl_generate(http, input_ids=PROMPT, return_logprob=True, sampling_params=GREEDY)
        assert out["meta_info"]["weight_version"] == str(version + 1)
        assert out["output_ids"] == hf_greedy(hf_model_with(server.model_folder, pushed), [PROMPT], 8)[0][0]
        checksum = http.get("/weights/checksum").json()["checksum"]
        assert checksum == weights_checksum(pushed.items(), torch.float32)

        # a wrong shape: every byte is taken (the trainer's broadcasts return), the push refused
        bad = {names[0]: torch.zeros(3, 3), names[1]: pushed[names[1]] * 2}
        r = push(http, pg, bad, group, weight_version=str(version + 2))
        assert r.status_code == 400 and r.json()["success"] is False and "shape" in r.json()["message"], r.text
        assert http.get("/weights/checksum").json()["checksum"] == checksum
        assert http.get("/get_weight_version").json()["weight_version"] == str(version + 1)
        assert sgl_generate(http, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == out["output_ids"]
        # a version that does not increase is refused after the bytes arrived, like every update here
        r = push(http, pg, {names[1]: pushed[names[1]]}, group, weight_version=str(version))
        assert r.status_code == 400 and r.json()["success"] is False, r.text
    finally:
        r = http.post("/destroy_weights_update_group", json={"group_name": group})
        dist.destroy_process_group(pg)
    assert r.json()["success"] is True
    assert http.post("/destroy_weights_update_group", json={"group_name": group}).json()["success"] is False
    assert http.post("/update_weights_from_distributed", json={
        "names": [], "dtypes": [], "shapes": [], "group_name": group}).json()["success"] is False


def test_update_weights_from_disk_sglang_body(server, http, tmp_path):
    """AReaL's disk update: {model_path, abort_all_requests: true}; a bad path is a 400 with
    SGLang's {success: false} and the weights stay."""
    state = perturbed_state(server.model_folder, seed=2)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    version = int(http.get("/get_weight_version").json()["weight_version"]) + 1
    r = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "abort_all_requests": True,
                                                     "weight_version": str(version)})
    assert r.status_code == 200 and r.json()["success"] is True and "num_paused_requests" in r.json(), r.text
    assert http.get("/get_weight_version").json()["weight_version"] == str(version)
    assert sgl_generate(http, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == \
        hf_greedy(hf_model_with(server.model_folder, state), [PROMPT], 8)[0][0]
    r = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert r.status_code == 400 and r.json()["success"] is False
    assert http.get("/get_weight_version").json()["weight_version"] == str(version)
    # our own body for the same route still works
    r = http.post("/update_weights_from_disk", json={"path": str(tmp_path), "version": version + 1})
    assert r.status_code == 200 and r.json()["weight_version"] == version + 1


def test_tensor_route_refused_clearly(http):
    r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["xx"], "flush_cache": False})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "update_weights_from_distributed" in r.json()["message"]


def test_routes_in_openapi(http):
    doc = http.get("/openapi.json").json()
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/pause_generation",
                 "/continue_generation", "/flush_cache", "/abort_request", "/v1/loads", "/get_weight_version",
                 "/health_generate", "/get_server_info", "/release_memory_occupation"):
        assert path in doc["paths"], path
    bodies = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    assert {b["$ref"].rsplit("/", 1)[1] for b in bodies} == {"GenerateRequest", "SGLangGenerateRequest"}
    assert "SGLangGenerateRequest" in doc["components"]["schemas"]
