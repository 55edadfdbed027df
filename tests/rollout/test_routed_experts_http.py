"""Routed experts over real HTTP: `rollout serve` of a tiny random Qwen3-MoE (3 layers, the middle
one dense; 8 experts, top 2) with --enable-return-routed-experts and two data-parallel replicas, in
float32. Every answer's rows are checked against transformers' router choices for the same tokens
(tests/engine/test_routed_experts.py): /generate (whole and streamed, n = 2, several requests at
once), a session's turns, an abort's partial answer, /v1/completions and /v1/chat/completions
(whole and streamed) and SGLang's /generate dialect. The session server of the default (dense)
model refuses the field on every route with a 400 naming it.
"""
import base64
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from rollout.client import RolloutClient, decode_routed_experts
from rollout.errors import RolloutAPIError
from tests.engine.test_routed_experts import TOP_K, assert_rows_match_hf, random_prompt
from tests.engine.test_tiny_models import build_model
from tests.rollout.conftest import ADMIN_KEY, API_KEY, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SP = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True, "return_routed_experts": True}


@pytest.fixture(scope="module")
def moe(tmp_path_factory, default_model_path):
    folder = tmp_path_factory.mktemp("qwen3_moe_served")
    model = build_model("qwen3_moe", folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the default model's
        shutil.copy(Path(default_model_path) / name, folder / name)
    server = start_server(str(folder), "--enable-return-routed-experts", "--data-parallel-size", "2")
    try:
        with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as client:
            yield model, server, client
    finally:
        assert stop_server(server) == 0, server.log()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=120)


def test_generate_rows_match_transformers_for_requests_at_once(moe):
    """Four /generate calls at the same time (spread over both replicas), one with n = 2 and one
    sharing the other's prefix: each sample's rows cover its prompt and output but the last token."""
    model, _, client = moe
    prompts = [random_prompt(40, 30), random_prompt(9, 31), random_prompt(25, 32)]
    prompts.append(prompts[0][:32] + random_prompt(5, 33))
    results: dict[int, list] = {}

    def run(i):
        results[i] = client.generate([prompts[i]], dict(SP, n=2 if i == 1 else 1, seed=i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        [out] = results[i]
        for sample in out if isinstance(out, list) else [out]:
            assert sample.routed_experts.flags.writeable  # (torch.from_numpy takes it without a copy)
            assert_rows_match_hf(model, prompt + sample.token_ids, sample.routed_experts)


def test_streamed_generate_sends_each_rows_once(moe):
    model, _, client = moe
    prompt = random_prompt(30, 34)
    deltas = [d for _, [d] in client.generate_stream([prompt], dict(SP, seed=5))]
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(deltas) > 2 and deltas[0].routed_experts.shape[0] == len(prompt)  # the prompt's rows come first
    assert_rows_match_hf(model, prompt + tokens, np.concatenate([d.routed_experts for d in deltas]))


def test_session_turns_cover_the_whole_conversation(moe):
    """Each turn's rows are the new ones (the previous turn's last token, the turn's input, its
    output but the last): concatenated, the rows of the whole conversation."""
    model, _, client = moe
    with client.session() as s:
        first = s.generate(random_prompt(20, 35), dict(SP, seed=1))
        second = s.generate(random_prompt(7, 36), dict(SP, seed=2))
        conversation = s.token_ids
    assert first.routed_experts.shape[0] == len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert second.routed_experts.shape[0] == len(second.prompt_token_ids) + len(second.token_ids)
    assert_rows_match_hf(model, conversation, np.concatenate([first.routed_experts, second.routed_experts]))


def test_an_aborted_stream_ends_with_the_rows_of_its_tokens_so_far(moe):
    model, _, client = moe
    prompt = random_prompt(12, 37)
    stream = client.generate_stream([prompt], dict(SP, max_tokens=480, seed=3), request_id="routed-abort")
    deltas = [next(stream)[1][0] for _ in range(3)]
    assert client.abort_requests(["routed-abort"]) == 1
    deltas += [d for _, [d] in stream]
    assert deltas[-1].finish_reason == "abort"
    tokens = [t for d in deltas for t in d.token_ids]
    assert 3 <= len(tokens) < 480
    assert_rows_match_hf(model, prompt + tokens, np.concatenate([d.routed_experts for d in deltas]))


def test_openai_routes_answer_each_choice_its_rows(moe):
    model, server, _ = moe
    prompt = random_prompt(21, 38)
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "n": 2, "temperature": 1.0,
                                         "return_token_ids": True, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["routed_experts"]["dtype"] == "int16"
        assert_rows_match_hf(model, prompt + ch["token_ids"], decode_routed_experts(ch["routed_experts"]))
    chat = {"messages": [{"role": "user", "content": "Route me"}], "max_tokens": 5, "temperature": 1.0,
            "return_token_ids": True, "return_routed_experts": True}
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    body = r.json()
    [ch] = body["choices"]
    assert_rows_match_hf(model, body["prompt_token_ids"] + ch["token_ids"], decode_routed_experts(ch["routed_experts"]))
    with httpx.stream("POST", server.url + "/v1/completions", headers=HEADERS, timeout=120,
                      json={"prompt": prompt, "max_tokens": 5, "temperature": 1.0, "stream": True,
                            "return_token_ids": True, "return_routed_experts": True}) as resp:
        chunks = [httpx.Response(200, content=line[6:]).json() for line in resp.iter_lines()
                  if line.startswith("data: {")]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    rows = [decode_routed_experts(ch["routed_experts"]) for c in chunks for ch in c["choices"] if "routed_experts" in ch]
    assert_rows_match_hf(model, prompt + tokens, np.concatenate(rows))


def test_sglang_generate_answers_base64_int32_from_routed_experts_start_len(moe):
    model, server, _ = moe
    prompt = random_prompt(15, 39)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True},
            "return_routed_experts": True, "routed_experts_start_len": 3}
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    flat = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")  # SGLang's: flattened
    assert_rows_match_hf(model, prompt + out["output_ids"], flat.reshape(-1, 3, TOP_K).astype(np.int16), start=3)
    with httpx.stream("POST", server.url + "/generate", json=dict(body, stream=True), headers=HEADERS,
                      timeout=120) as resp:
        events = [httpx.Response(200, content=line[6:]).json() for line in resp.iter_lines()
                  if line.startswith("data: {")]
    assert len(events) > 1 and ["routed_experts" in e["meta_info"] for e in events] == [False] * (len(events) - 1) + [
        True]  # with the sequence's end, as SGLang sends it
    last = events[-1]
    flat = np.frombuffer(base64.b64decode(last["meta_info"]["routed_experts"]), dtype="<i4")
    assert_rows_match_hf(model, prompt + last["output_ids"], flat.reshape(-1, 3, TOP_K).astype(np.int16), start=3)
    bad = post(server, "/generate", dict(body, routed_experts_start_len=len(prompt) + 1))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "routed_experts_start_len", bad.text


def test_refused_by_a_dense_model_server_on_every_route(server):
    """The session server's default model is dense: a 400 naming the field, before any work."""
    cases = [("/generate", {"prompt": "Hi", "sampling_params": {"return_routed_experts": True}},
              "sampling_params.return_routed_experts"),
             ("/v1/completions", {"prompt": "Hi", "return_routed_experts": True}, "return_routed_experts"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "return_routed_experts": True},
              "return_routed_experts"),
             ("/generate", {"text": "Hi", "return_routed_experts": True}, "return_routed_experts")]  # SGLang's
    for path, body, param in cases:
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == param and "dense" in error["message"], (path, error)
    with RolloutClient(server.url, api_key=API_KEY) as client, pytest.raises(RolloutAPIError) as e:
        client.generate(["Hi"], {"return_routed_experts": True})
    assert e.value.status == 400 and e.value.param == "sampling_params.return_routed_experts"
