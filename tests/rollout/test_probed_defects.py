"""The defects found by probing the served API as an outside tester, one
test each, against the real server:

- pause / resume / sleep / wake_up sequences that used to wedge generation;
- a pause's deadline (timeout_s): it lifts itself, /health says how long it has lasted;
- the client's timeout applies to generation (TimeoutError, and the server drops the request);
- a lone surrogate anywhere in a body: a 400 naming the field, the connection stays usable;
- bad admin input is a 4xx naming the problem (corrupt checkpoint, nccl on CPU, a master that
  never answers, a non-positive timeout), weights untouched;
- forming a weight transfer group does not stall generation; a client that goes away cancels it;
- weight versions increase strictly (409 naming weight_version);
- the OpenAPI document says 400 (what the server sends), a 405 carries Allow;
- API keys: once any key is set, admin routes need the admin key (in process, no engine).
"""
import asyncio
import threading
import time

import httpx
import pytest

from rollout.client import RolloutAPIError, RolloutClient
from rollout.config import ServerConfig
from rollout.server import build_app
from tests.rollout.conftest import ADMIN_KEY, API_KEY

USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SHORT = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


def generates(client, within_s: float = 60) -> bool:
    """A short generation completes (run in a thread so that a wedge fails instead of hanging)."""
    box = {}
    t = threading.Thread(target=lambda: box.update(out=client.generate("Hi", SHORT)[0]), daemon=True)
    t.start()
    t.join(within_s)
    return not t.is_alive() and len(box["out"].token_ids) == 4


def test_control_sequences_that_wedged_generation(client):
    for calls in ([("pause", {"mode": "keep"}), ("pause", {"mode": "abort"}), ("resume", {})],
                  [("sleep", {"mode": "keep"}), ("pause", {"mode": "wait"}), ("wake_up", {}), ("resume", {})],
                  [("pause", {"mode": "keep"}), ("sleep", {"mode": "abort"}), ("wake_up", {}), ("resume", {})]):
        for name, kwargs in calls:
            getattr(client, name)(**kwargs)
        assert not client.is_paused() and not client.is_sleeping(), calls
        assert generates(client), f"generation hangs after {calls}"


def test_a_pause_with_a_deadline_lifts_itself(client, server):
    client.pause(mode="keep", timeout_s=1.5)
    try:
        health = httpx.get(server.url + "/health", timeout=10).json()
        assert health["status"] == "ok" and 0 <= health["paused_seconds"] < 1.5
        deadline = time.monotonic() + 10
        while client.is_paused():
            assert time.monotonic() < deadline, "the pause outlived its timeout_s"
            time.sleep(0.1)
        assert "paused_seconds" not in httpx.get(server.url + "/health", timeout=10).json()
        assert generates(client)
        assert "nobody resumed" in server.log()
    finally:
        client.resume()
    with pytest.raises(RolloutAPIError) as e:
        client.pause(timeout_s=0)
    assert e.value.status == 400 and e.value.param == "timeout_s"


def test_the_client_timeout_applies_to_generation(client, server):
    client.pause(mode="keep")
    try:
        with RolloutClient(server.url, api_key=API_KEY, timeout=2) as quick:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="/generate"):
                quick.generate("Hi", SHORT)
            assert time.monotonic() - t0 < 10
            with pytest.raises(TimeoutError):
                for _ in quick.generate_stream("Hi", SHORT):
                    pass
        deadline = time.monotonic() + 10  # the server dropped what the client left behind
        while client.server_info()["requests_in_flight"]:
            assert time.monotonic() < deadline, "requests of a client that timed out stayed in flight"
            time.sleep(0.1)
    finally:
        client.resume()


@pytest.mark.parametrize("path, body, param", [
    ("/generate", '{"prompt": "a\\ud800b", "sampling_params": {"max_tokens": 2}}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/completions", '{"prompt": "ab", "max_tokens": 2, "stop": ["\\ud800"]}', "stop[0]"),
    ("/generate", '{"prompt": "a", "\\ud800": 1}', "a key"),
])
def test_a_lone_surrogate_is_a_clean_400_and_the_connection_lives(server, path, body, param):
    with httpx.Client(base_url=server.url, headers=USER, timeout=60) as http:
        r = http.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "surrogate" in err["message"], err
        ok = http.post("/generate", json={"prompt": "Hi", "sampling_params": SHORT})  # same connection
        assert ok.status_code == 200
    assert "TextEncodeInput" not in server.log()


def test_bad_admin_input_is_a_4xx_naming_the_problem(client, server, tmp_path):
    before = client.weights_checksum()
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    cases = [
        ("/update_weights_from_disk", {"path": str(tmp_path)}, "path", "safetensors"),
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 9,
                                                        "world_size": 2, "backend": "nccl"}},
         "init_info.backend", "nccl"),
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 9,
                                                        "world_size": 2, "timeout_s": 1}}, "init_info", "trainer"),
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 9,
                                                        "world_size": 2, "timeout_s": 10 ** 6}},
         "init_info.timeout_s", "600"),
        ("/collective_rpc", {"method": "ping", "timeout": 0}, "timeout", "greater than 0"),
    ]
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=60) as http:
        for path, body, param, words in cases:
            t0 = time.monotonic()
            r = http.post(path, json=body)
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (path, err)
            assert time.monotonic() - t0 < 5, f"{path} took {time.monotonic() - t0:.1f} s"
    assert client.weights_checksum() == before
    assert generates(client)


def test_forming_a_group_does_not_stall_generation_and_a_disconnect_cancels_it(client, server):
    body = {"init_info": {"master_address": "127.0.0.1", "master_port": 9, "world_size": 2, "timeout_s": 30}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s: the server stops forming
        httpx.post(server.url + "/init_weight_transfer_engine", json=body, headers=ADMIN, timeout=1.0)
    body["init_info"]["timeout_s"] = 3
    forming = threading.Thread(target=lambda: httpx.post(server.url + "/init_weight_transfer_engine", json=body,
                                                         headers=ADMIN, timeout=30), daemon=True)
    forming.start()  # a second attempt is taken (not 409: the first was cancelled) and forms for 3 s
    time.sleep(0.3)
    t0 = time.monotonic()
    assert generates(client, within_s=30)
    assert time.monotonic() - t0 < 2.5, "generation waited for the group to form"
    assert forming.is_alive()
    forming.join(30)


def test_weight_versions_increase_strictly(client, model_path):
    version = client.weight_version() + 1
    assert client.push_weights_from_disk(model_path, version=version)["weight_version"] == version
    for stale in (version, version - 1):
        with pytest.raises(RolloutAPIError) as e:
            client.push_weights_from_disk(model_path, version=stale)
        assert e.value.status == 409 and e.value.param == "weight_version" and "increase" in e.value.message
    assert client.weight_version() == version
    assert client.reload_weights()["weight_version"] == version + 1
    assert generates(client)


def test_openapi_says_400_and_405_says_allow(server):
    doc = httpx.get(server.url + "/openapi.json", headers=USER, timeout=30).json()
    codes = {c for item in doc["paths"].values() for op in item.values() for c in op["responses"]}
    assert "422" not in codes and "400" in codes
    assert "ErrorResponse" in doc["components"]["schemas"]
    r = httpx.get(server.url + "/pause", headers=ADMIN, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "stop": ["a", 5]}, headers=USER, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop[1]", r.text


# (api_key, admin_api_key) -> {(route, token): denied status, or None when the key check lets it through}
KEY_RULES = {
    ("u", None): {("/v1/models", None): 401, ("/v1/models", "u"): None, ("/pause", "u"): 403,
                  ("/pause", None): 403},
    (None, "a"): {("/v1/models", None): 401, ("/v1/models", "a"): None, ("/pause", "a"): None,
                  ("/pause", None): 401, ("/pause", "u"): 401},
    ("u", "a"): {("/v1/models", "u"): None, ("/v1/models", "a"): None, ("/pause", "u"): 403,
                 ("/pause", "a"): None, ("/pause", "x"): 401},
    (None, None): {("/v1/models", None): None, ("/pause", None): None},
}


@pytest.mark.parametrize("keys", list(KEY_RULES))
def test_api_key_rules(keys):
    app = build_app(engine=None, config=ServerConfig(api_key=keys[0], admin_api_key=keys[1]))

    async def check():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # no engine: passed = not 401/403
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            for (path, token), want in KEY_RULES[keys].items():
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                r = await http.request("GET" if path == "/v1/models" else "POST", path, headers=headers)
                got = r.status_code if r.status_code in (401, 403) else None
                assert got == want, (keys, path, token, r.status_code, r.text)

    asyncio.run(check())


def test_a_prompt_longer_than_the_context_can_spell_is_refused_untokenized(server):
    with httpx.Client(base_url=server.url, headers=USER, timeout=60) as http:
        t0 = time.monotonic()  # longer than any max_model_len tokens can spell: refused untokenized
        r = http.post("/generate", json={"prompt": "x" * 900_000})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 2


def _ttft(client) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for fam in text_string_to_metric_families(client.metrics()):
        for s in fam.samples:
            if s.name in ("rollout_time_to_first_token_seconds_sum", "rollout_time_to_first_token_seconds_count"):
                found[s.name.rsplit("_", 1)[1]] = s.value
    return found["sum"], found["count"]


def test_ttft_of_a_non_streamed_request_is_its_first_token_not_its_end(client):
    s0, n0 = _ttft(client)
    t0 = time.monotonic()
    client.generate("Tell me a story.", {"temperature": 0, "max_tokens": 120, "ignore_eos": True})
    duration = time.monotonic() - t0
    s1, n1 = _ttft(client)
    assert n1 == n0 + 1
    assert s1 - s0 < duration / 3, f"TTFT {s1 - s0:.2f} s of a {duration:.2f} s request"


def test_max_tokens_beyond_the_context_is_a_400(server):
    from tests.rollout.conftest import MAX_MODEL_LEN

    with httpx.Client(base_url=server.url, headers=USER, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": MAX_MODEL_LEN})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        r = http.post("/generate", json={"prompt": "a", "sampling_params": {"max_tokens": 10 ** 6}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.max_tokens", r.text
        # within the context alone, but not with the prompt: it runs to the context's end
        r = http.post("/generate", json={"prompt_token_ids": [1] * 500,
                                         "sampling_params": {"max_tokens": 100, "ignore_eos": True}})
        out = r.json()["results"][0]["outputs"][0]
        assert r.status_code == 200 and out["finish_reason"] == "length" and len(out["token_ids"]) == 12


def test_chat_messages_through_generate_and_the_tokenizer_routes(client, server):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = client.tokenize(messages=messages)
    assert client.detokenize(ids).startswith("<|im_start|>")
    out = client.generate_chat(messages, {"temperature": 0, "max_tokens": 8})
    assert out.prompt_token_ids == ids
    chat = client.chat_completions(messages, max_tokens=8, temperature=0, return_token_ids=True)
    assert chat["choices"][0]["token_ids"] == out.token_ids  # the same rendering as the chat route
    assert client.tokenize("hello world") == client.generate("hello world", {"max_tokens": 1})[0].prompt_token_ids
    with httpx.Client(base_url=server.url, headers=USER, timeout=30) as http:
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] and info["chat_template"]
        assert http.get("/version").json()["version"]
        r = http.post("/detokenize", json={"tokens": [1, 10 ** 9]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
        r = http.post("/generate", json={"prompt": "a", "messages": messages})
        assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]


def test_accepted_connections_have_nagle_off():
    """The listening socket says TCP, so asyncio turns Nagle off on every accepted connection:
    with Nagle on, a response's second write (the body after the headers, each SSE chunk after
    the first) waited for the client's delayed ACK, and every keep-alive request took ~44 ms
    (found probing /health under load)."""
    import socket

    from rollout.listen import listen

    sock = listen(ServerConfig(host="127.0.0.1", port=0))
    assert sock.proto == socket.IPPROTO_TCP

    async def accepted_nodelay() -> int:
        got = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            got.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(got, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
