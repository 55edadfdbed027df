"""vLLM's RL routes as SkyRL and prime-rl call them (rollout/compat/vllm_rl.py), on real `rollout
serve` processes. Neither framework's client installs on this CPU machine (SkyRL pulls Ray and
vLLM, prime-rl a CUDA vLLM and verifiers), so each test reproduces the calls of:

- NovaSky-AI/SkyRL skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py:
  `_generate_single` (POST /inference/v1/generate {"sampling_params", "model", "token_ids"},
  header X-Session-ID; reads choices[0].token_ids / finish_reason / logprobs.content[].logprob),
  `reset_prefix_cache` (POST /reset_prefix_cache with a JSON body {"reset_running_requests"}),
  `pause` (POST /pause?mode=keep&clear_cache=false);
- PrimeIntellect-ai/prime-rl src/prime_rl/utils/client.py: `update_weights` (POST
  /pause?mode=keep&clear_cache=false, touch weight_dir/NCCL_READY, POST /update_weights
  {"weight_dir"}, POST /resume), `load_lora_adapter` (POST /load_lora_adapter {"lora_name",
  "lora_path"}), `init_nccl_broadcast` (POST /init_broadcaster); its server's GET /liveness
  (src/prime_rl/inference/vllm/server.py);
- PrimeIntellect-ai/renderers renderers/client.py `_VllmGenerateTransport.post` (POST
  /inference/v1/generate {"model", "token_ids", "sampling_params": {..., "stop_token_ids",
  "logprobs": 1, "skip_special_tokens": false}} with X-data-parallel-rank among its headers);
- vLLM's token-in/token-out protocol (vllm/entrypoints/scale_out/token_in_token_out/protocol.py,
  serving.py) and its RL router (vllm/entrypoints/rl/online/api_router.py: /update_weight_version,
  /weight_info, /weight_checker).

Greedy outputs are checked token for token against our /generate and transformers (float32).
"""
import hashlib
import json
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.engine.hf_reference import CHATS, chat_token_ids, hf_greedy, load_hf
from tests.engine.perturb import hf_model_with, perturbed_state
from tests.rollout.conftest import ADMIN_KEY, API_KEY, children_of, start_server, stop_server
from weight_sync import load_safetensors_folder

USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NUM_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    s = start_server()
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=USER, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def admin(server):
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def prompts(default_model_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    return chat_token_ids(AutoTokenizer.from_pretrained(default_model_path), CHATS[:3])


@pytest.fixture(scope="module")
def hf_start(default_model_path, prompts):
    """transformers' greedy tokens and logprobs on the start-up weights."""
    return hf_greedy(load_hf(default_model_path), prompts, NUM_TOKENS)


def tito(http, token_ids, sampling_params, headers=None, **body) -> httpx.Response:
    return http.post("/inference/v1/generate", json=dict(body, token_ids=token_ids, sampling_params=sampling_params),
                     headers=headers)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def sse_chunks(text: str) -> list:
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(ln) for ln in lines[:-1]]


def test_skyrl_and_renderers_generate_equal_ours_and_transformers(http, model_name, prompts, hf_start):
    """SkyRL's body and the renderers transport's body (with its X-data-parallel-rank header):
    token for token our /generate and transformers; logprobs in vLLM's shape."""
    for prompt, (hf_tokens, hf_logprobs, _) in zip(prompts, hf_start):
        ours = http.post("/generate", json={"prompt_token_ids": prompt, "sampling_params": dict(GREEDY, logprobs=0)})
        ours = ours.json()["results"][0]["outputs"][0]
        skyrl = tito(http, prompt, dict(GREEDY, logprobs=0), model=model_name, headers={"X-Session-ID": "s-1"})
        assert skyrl.status_code == 200, skyrl.text
        body = skyrl.json()
        [choice] = body["choices"]
        assert choice["token_ids"] == ours["token_ids"] == hf_tokens
        assert choice["finish_reason"] == "length" and body["request_id"] and body["model"] == model_name
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in hf_tokens]
        assert [c["logprob"] for c in content] == pytest.approx(ours["logprobs"], abs=1e-4)  # (a prefix hit: other kernels)
        assert [c["logprob"] for c in content] == pytest.approx(hf_logprobs, abs=1e-3)
        assert all([t["token_id"] for t in c["top_logprobs"]] == [c["token_id"]] for c in content)  # max(0, 1) = 1
        assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == NUM_TOKENS
        assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": NUM_TOKENS}]

        renderers = tito(http, prompt, dict(GREEDY, stop_token_ids=[2], logprobs=1, skip_special_tokens=False, top_k=-1,
                                            min_p=0.0, min_tokens=0, repetition_penalty=1.0),
                         model=model_name, headers={"X-data-parallel-rank": "0"})
        assert renderers.status_code == 200, renderers.text
        [choice] = renderers.json()["choices"]
        want = hf_tokens[:hf_tokens.index(2) + 1] if 2 in hf_tokens else hf_tokens
        assert choice["token_ids"] == want


def test_streamed_generate_is_the_same_tokens_in_sse_deltas(http, prompts, hf_start):
    r = tito(http, prompts[0], dict(GREEDY, logprobs=2), stream=True, return_token_ids=True,
             stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    chunks = sse_chunks(r.text)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert [t for d in deltas for t in d["token_ids"]] == hf_start[0][0]
    content = [c for d in deltas for c in d["logprobs"]["content"]]
    assert len(content) == NUM_TOKENS and all(len(c["top_logprobs"]) == 2 for c in content)
    assert [d["finish_reason"] for d in deltas][-1] == "length" and chunks[0]["prompt_token_ids"] == prompts[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS


def test_openai_package_with_vllm_extra_body(server, model_name, prompts, hf_start):
    """prime-rl's chat path (src/prime_rl/orchestrator/utils.py get_sampling_args through the
    verifiers client): the official `openai` package with vLLM's fields in `extra_body`
    (return_token_ids, top_k -1, min_p, min_tokens, repetition_penalty, cache_salt) and routing
    headers in `extra_headers`; token ids come back in the answer's extra fields."""
    from openai import OpenAI

    from tests.engine.hf_reference import CHATS

    oai = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    extra = {"return_token_ids": True, "top_k": -1, "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0,
             "cache_salt": "run-1", "ignore_eos": True}
    chat = oai.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=NUM_TOKENS, temperature=0,
                                       logprobs=True, extra_body=extra, extra_headers={"X-Session-ID": "s-1"})
    assert chat.model_extra["prompt_token_ids"] == prompts[0]
    assert chat.choices[0].model_extra["token_ids"] == hf_start[0][0]
    assert len(chat.choices[0].logprobs.content) == NUM_TOKENS
    done = oai.completions.create(model=model_name, prompt=prompts[1], max_tokens=NUM_TOKENS, temperature=0,
                                  extra_body=extra, extra_headers={"X-data-parallel-rank": "0"})
    assert done.choices[0].model_extra["token_ids"] == hf_start[1][0]
    assert done.choices[0].model_extra["prompt_token_ids"] == prompts[1]


def test_bad_input_is_a_400_in_our_shape_and_the_server_keeps_serving(http, prompts, hf_start):
    cases = [
        ({"token_ids": [5, -1, 7], "sampling_params": GREEDY}, None, "token_ids"),
        ({"token_ids": [], "sampling_params": GREEDY}, None, "token_ids"),
        ({"token_ids": [5, 6], "sampling_params": dict(GREEDY, best_of_n=2)}, None, "sampling_params.best_of_n"),
        ({"token_ids": [5, 6], "sampling_params": dict(GREEDY, presence_penalty=0.3)}, None,
         "sampling_params.presence_penalty"),
        ({"token_ids": [5, 6], "sampling_params": dict(GREEDY, logprobs=-1)}, None, "sampling_params.logprobs"),
        ({"token_ids": [5, 6], "sampling_params": GREEDY, "priority": 1}, None, "priority"),
        ({"token_ids": [5, 6], "sampling_params": GREEDY, "features": {"mm_hashes": {}, "mm_placeholders": {}}}, None,
         "features"),
        ({"token_ids": [5, 6], "sampling_params": GREEDY, "cache_salt": ""}, None, "cache_salt"),
        ({"token_ids": [5, 10 ** 9], "sampling_params": GREEDY}, None, "token_ids"),
        ({"token_ids": [5, 6], "sampling_params": GREEDY}, {"X-data-parallel-rank": "one"}, "X-data-parallel-rank"),
        ({"token_ids": [5, 6], "sampling_params": GREEDY}, {"X-data-parallel-rank": "1"}, "data_parallel_rank"),
    ]
    for body, headers, param in cases:
        r = http.post("/inference/v1/generate", json=body, headers=headers)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == 400 and error["param"] == param and error["message"], (body, error)
    r = http.post("/inference/v1/generate", json={"token_ids": [5], "sampling_params": GREEDY, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert tito(http, prompts[0], GREEDY).json()["choices"][0]["token_ids"] == hf_start[0][0]


def test_max_tokens_left_out_fills_the_context(http):
    """vLLM's server fills max_tokens in with the room the context leaves (max_model_len 512)."""
    r = tito(http, [300] * 500, {"temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert len(choice["token_ids"]) == 12 and choice["finish_reason"] == "length"


def test_two_cache_salts_never_share_prefix_blocks(http):
    prompt = [(17 * i + 5) % 40000 + 100 for i in range(80)]  # 5 full blocks of 16
    salt_a, salt_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    params = {"temperature": 0.0, "max_tokens": 2}
    assert cached(tito(http, prompt, params, cache_salt=salt_a)) == 0
    assert cached(tito(http, prompt, params, cache_salt=salt_a)) == 64  # the prefix's full blocks, less the last
    assert cached(tito(http, prompt, params, cache_salt=salt_b)) == 0
    assert cached(tito(http, prompt, params)) == 0  # no salt is a namespace of its own
    assert cached(tito(http, prompt, params, cache_salt=salt_b)) == 64
    assert cached(tito(http, prompt, params, cache_salt=salt_a)) == 64


def test_skyrl_reset_prefix_cache_takes_a_json_body(http, admin):
    prompt = [(29 * i + 11) % 40000 + 100 for i in range(48)]
    params = {"temperature": 0.0, "max_tokens": 2}
    tito(http, prompt, params)
    assert cached(tito(http, prompt, params)) == 32
    r = admin.post("/reset_prefix_cache", json={"reset_running_requests": True})  # SkyRL's call
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    assert cached(tito(http, prompt, params)) == 0
    assert admin.post("/reset_prefix_cache", params={"reset_running_requests": "true"}).status_code == 200  # vLLM's
    assert cached(tito(http, prompt, params)) == 0
    r = admin.post("/reset_prefix_cache", json={"reset_running_request": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reset_running_request"


def test_pause_as_prime_rl_and_vllm_send_it(admin):
    for params in ({}, {"mode": "keep", "clear_cache": "false"}):
        r = admin.post("/pause", params=params)
        assert r.status_code == 200 and r.json()["status"] == "paused", r.text
        assert admin.get("/is_paused").json() == {"is_paused": True}
        assert admin.post("/resume").json()["status"] == "resumed"
    assert admin.get("/is_paused").json() == {"is_paused": False}


def test_liveness_pings_every_engine_core(server, http):
    """prime-rl's probe: 200 while the engine core answers (paused too), 503 while it is stuck."""
    assert http.get("/liveness").json() == {"status": "ok"}
    [core] = children_of(server.proc.pid)
    os.kill(core, signal.SIGSTOP)  # stuck: alive, answering nothing
    try:
        t0 = time.monotonic()
        r = http.get("/liveness", params={"timeout_s": 2})
        assert r.status_code == 503 and r.json()["status"] == "engine_unresponsive", r.text
        assert 1.5 < time.monotonic() - t0 < 10
    finally:
        os.kill(core, signal.SIGCONT)
    assert http.get("/liveness").json() == {"status": "ok"}


def test_weight_version_and_weight_checker(http, admin, default_model_path):
    """vLLM's /update_weight_version and /weight_checker: versions are integers that only
    increase; the checksums are per tensor, and match sha256 of the checkpoint's bytes."""
    version = admin.get("/weight_info").json()["weight_version"]
    r = admin.post("/update_weight_version", json={"new_version": str(version + 3)})
    assert r.status_code == 200 and r.json()["success"] and r.json()["new_version"] == str(version + 3), r.text
    assert http.get("/weight_info").json() == {"weight_version": version + 3}
    assert admin.post("/update_weight_version", json={"new_version": version + 4}).status_code == 200
    for bad, status in (("step-7", 400), ("1.5", 400), (1 << 63, 400), (version + 2, 409)):
        r = admin.post("/update_weight_version", json={"new_version": bad})
        assert r.status_code == status and r.json()["error"]["param"] == "new_version", (bad, r.text)
    assert http.get("/weight_info").json() == {"weight_version": version + 4}

    checksums = admin.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    on_disk = dict(load_safetensors_folder(default_model_path))
    assert {k.removeprefix("dp0:pp0:pcp0:tp0:") for k in checksums} == set(on_disk) - {"lm_head.weight"}
    embed = on_disk["model.embed_tokens.weight"].float().contiguous()
    assert checksums["dp0:pp0:pcp0:tp0:model.embed_tokens.weight"] == \
        hashlib.sha256(embed.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    assert admin.post("/weight_checker", json={"action": "compare", "baseline": checksums}).json() == \
        {"match": True, "mismatches": []}
    key = "dp0:pp0:pcp0:tp0:model.norm.weight"
    changed = dict(checksums, **{key: "0" * 64, "dp0:pp0:pcp0:tp0:extra": "1"})
    assert admin.post("/weight_checker", json={"action": "compare", "baseline": changed}).json() == \
        {"match": False, "mismatches": sorted([key, "dp0:pp0:pcp0:tp0:extra"])}
    for body, param in (({"action": "compare"}, "baseline"), ({"action": "reset"}, "action"),
                        ({"action": "zero"}, "action")):
        r = admin.post("/weight_checker", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert http.post("/weight_checker", json={"action": "checksum"}).status_code == 403  # an admin route


def test_prime_rl_weight_update_cycle(http, admin, default_model_path, prompts, hf_start, tmp_path):
    """prime-rl's update_weights(): /pause?mode=keep&clear_cache=false, NCCL_READY in weight_dir,
    /update_weights {"weight_dir"}, /resume. A request in flight stays frozen and goes on with the
    new weights; afterwards outputs equal transformers on the new weights and /weight_info shows
    the next version; a bad weight_dir is a 400 and the new weights keep serving."""
    state = perturbed_state(default_model_path)
    step = tmp_path / "step_1"
    step.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, step / "model.safetensors")
    expected = [t for t, _, _ in hf_greedy(hf_model_with(default_model_path, state), prompts, NUM_TOKENS)]
    version = admin.get("/weight_info").json()["weight_version"]
    before = admin.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]

    chunks: list = []
    first = threading.Event()

    def in_flight():
        body = {"token_ids": prompts[1], "stream": True,
                "sampling_params": {"temperature": 0.0, "max_tokens": 160, "ignore_eos": True}}
        with httpx.Client(base_url=http.base_url, headers=USER, timeout=300) as c, \
                c.stream("POST", "/inference/v1/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    first.set()

    thread = threading.Thread(target=in_flight)
    thread.start()
    try:
        assert first.wait(120)
        r = admin.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert r.status_code == 200 and r.json()["status"] == "paused", r.text
        (step / "NCCL_READY").touch()  # (prime-rl's marker for its NCCL transport)
        r = admin.post("/update_weights", json={"weight_dir": step.as_posix()})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "ok" and r.json()["weight_version"] == version + 1
    finally:
        assert admin.post("/resume").status_code == 200
        thread.join(300)
    try:
        spans = chunks[-1]["choices"][0]["weight_versions"]
        assert [s["version"] for s in spans] == [str(version), str(version + 1)], spans  # frozen, then on
        assert spans[-1]["end"] == 160
        assert http.get("/weight_info").json() == {"weight_version": version + 1}
        for prompt, want in zip(prompts, expected):
            assert tito(http, prompt, GREEDY).json()["choices"][0]["token_ids"] == want
        assert expected[0] != hf_start[0][0]
        compared = admin.post("/weight_checker", json={"action": "compare", "baseline": before}).json()
        assert not compared["match"] and len(compared["mismatches"]) == len(before)

        wrong = tmp_path / "wrong_shape"
        wrong.mkdir()
        state["model.norm.weight"] = state["model.norm.weight"][:-1]
        save_file({k: v.contiguous() for k, v in state.items()}, wrong / "model.safetensors")
        for weight_dir in (str(tmp_path / "missing"), str(wrong)):
            r = admin.post("/update_weights", json={"weight_dir": weight_dir})
            assert r.status_code == 400 and r.json()["error"]["param"] == "weight_dir", r.text
        assert http.get("/weight_info").json() == {"weight_version": version + 1}
        assert tito(http, prompts[0], GREEDY).json()["choices"][0]["token_ids"] == expected[0]
    finally:
        assert admin.post("/reload_weights").status_code == 200  # the start-up weights for the other tests
    assert tito(http, prompts[0], GREEDY).json()["choices"][0]["token_ids"] == hf_start[0][0]


def test_update_weights_takes_both_bodies(http, admin):
    """/update_weights: vLLM's {"update_info"} (SkyRL's update_named_weights) and prime-rl's
    {"weight_dir"}, both in /openapi.json; prime-rl's NCCL transport (weight_dir null: 400,
    /init_broadcaster: 501) is refused naming our weight routes."""
    body = http.get("/openapi.json").json()["paths"]["/update_weights"]["post"]["requestBody"]
    refs = [x["$ref"] for x in body["content"]["application/json"]["schema"]["oneOf"]]
    assert refs == ["#/components/schemas/UpdateWeightsBody", "#/components/schemas/WeightDirBody"]
    r = admin.post("/update_weights", json={"update_info": {}})  # no transfer group: the engine's 409
    assert r.status_code == 409, r.text
    r = admin.post("/update_weights", json={"weight_dir": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weight_dir", r.text
    assert "/init_weight_transfer_engine" in r.json()["error"]["message"]
    r = admin.post("/update_weights", json={"weight_dir": "/tmp", "update_info": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "update_info", r.text
    r = admin.post("/init_broadcaster", json={"host": "127.0.0.1", "port": 29500, "rank_offset": 0,
                                              "inference_world_size": 1, "timeout": 60})
    assert r.status_code == 501 and "/init_weight_transfer_engine" in r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, default_model_path):
    from tests.engine.test_lora import build_models

    root = tmp_path_factory.mktemp("vllm_rl_lora")
    folder, _, adapters = build_models(root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path) / name, Path(folder) / name)
    s = start_server(folder, "--enable-lora", "--max-model-len", "256")  # (the tiny model's context)
    yield s, adapters
    assert stop_server(s) == 0, s.log()


def test_prime_rl_loads_a_lora_adapter_in_place(lora_server):
    """prime-rl's load_lora_adapter(): the same name every step, a new folder each time; requests
    name the adapter as `model` and get its outputs, never the previous adapter's KV."""
    from tests.engine.test_lora import reference

    s, adapters = lora_server
    prompt = [5, 6, 7, 8, 9]
    with httpx.Client(base_url=s.url, headers=ADMIN, timeout=120) as c:
        for path, peft_model in adapters[:2]:
            r = c.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": path})
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
            out = tito(c, prompt, GREEDY, model="policy")
            assert out.json()["choices"][0]["token_ids"] == reference(peft_model, prompt), out.text
            assert out.json()["model"] == "policy"
        r = c.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(Path(path).parent / "none")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert tito(c, prompt, GREEDY, model="policy").json()["choices"][0]["token_ids"] == \
            reference(adapters[1][1], prompt)


FOLLOW_UP = "<|im_end|>\n<|im_start|>user\nTell me more, briefly.<|im_end|>\n<|im_start|>assistant\n"
NUM_TURNS, ANSWER_TOKENS, BLOCK = 4, 16, 16


def run_turns(http, first_prompts: list[list[int]], follow_up: list[int], headers_of) -> tuple[list, list]:
    """Every conversation turn by turn, the turns of all conversations at once: turn k's prompt
    is turn k-1's prompt + its answer + `follow_up`. Returns (prompts, cached tokens) [conv][turn]."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[p] for p in first_prompts]
    hits: list[list[int]] = [[] for _ in first_prompts]
    params = {"temperature": 0.0, "max_tokens": ANSWER_TOKENS, "ignore_eos": True}
    with ThreadPoolExecutor(len(first_prompts)) as pool:
        for turn in range(NUM_TURNS):
            def one(i, turn=turn):
                return tito(http, prompts[i][turn], params, headers=headers_of(i))
            for i, r in enumerate(pool.map(one, range(len(first_prompts)))):
                hits[i].append(cached(r))
                if turn + 1 < NUM_TURNS:
                    prompts[i].append(prompts[i][turn] + r.json()["choices"][0]["token_ids"] + follow_up)
    return prompts, hits


@pytest.mark.slow
def test_session_ids_keep_conversations_on_one_replica_with_dp2(default_model_path):
    """-dp 2: SkyRL's X-Session-ID (its router's affinity, here the server's) keeps every turn of
    a conversation on one replica: each turn finds the previous turn's prompt and answer cached
    (a turn on the other replica would find the shared system prompt's one block at most), and
    the 20 conversations reuse >= 90% of the prefix tokens one replica reuses for the same turns.
    X-data-parallel-rank (prime-rl's per-rank clients) pins a request; a bad value is a 400.
    (No route reports per-replica hit counters: replica placement is read off the cache hits.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    first = chat_token_ids(tokenizer, CHATS[:20])
    follow_up = tokenizer.encode(FOLLOW_UP, add_special_tokens=False)
    server = start_server("--data-parallel-size", "2")
    try:
        with httpx.Client(base_url=server.url, headers=USER, timeout=600) as http, \
                httpx.Client(base_url=server.url, headers=ADMIN, timeout=600) as admin:
            prompts, hits = run_turns(http, first, follow_up, lambda i: {"X-Session-ID": f"conversation-{i}"})
            for i in range(len(first)):
                for turn in range(1, NUM_TURNS):
                    before = len(prompts[i][turn - 1]) + ANSWER_TOKENS - 1  # the last answer token has no KV yet
                    assert hits[i][turn] >= before // BLOCK * BLOCK >= 2 * BLOCK, (i, turn, hits[i])

            assert admin.post("/reset_prefix_cache", json={"reset_running_requests": False}).status_code == 200
            _, one_replica = run_turns(http, first, follow_up, lambda i: {"X-data-parallel-rank": "0"})
            total, baseline = sum(map(sum, hits)), sum(map(sum, one_replica))
            assert total >= 0.9 * baseline, (total, baseline)

            prompt = [(13 * i + 7) % 40000 + 100 for i in range(80)]
            params = {"temperature": 0.0, "max_tokens": 2}
            on = [cached(tito(http, prompt, params, headers={"X-data-parallel-rank": rank}))
                  for rank in ("1", "1", "0", "1", "0")]
            assert on == [0, 64, 0, 64, 64], on  # the blocks live where the rank header put them
            for bad in ("x", "2", "-1", "1.0"):
                r = tito(http, prompt, params, headers={"X-data-parallel-rank": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] in \
                    ("X-data-parallel-rank", "data_parallel_rank"), (bad, r.text)
            assert http.get("/liveness").json() == {"status": "ok"}  # through both engine cores
    finally:
        assert stop_server(server) == 0, server.log()
