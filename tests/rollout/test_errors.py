"""Bad requests, table-driven: each gets its status code and a JSON error whose message and
`param` name the field at fault; afterwards the server still serves a normal request. With API
keys set, every route but /health refuses a request without the key (all of the app's routes,
enumerated from the app itself), and admin routes refuse the user key."""
import httpx
import pytest

from rollout.server import OPEN_PATHS, build_app, iter_routes
from tests.rollout.conftest import ADMIN_KEY, API_KEY, MAX_BODY_BYTES, MAX_MODEL_LEN

USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
G = "/generate"
C = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (id, method, path, request kwargs, status, param (or None), words the message must contain)
CASES = [
    # wrong types
    ("prompt-int", "POST", G, dict(json={"prompt": 5}), 400, "prompt", ["prompt"]),
    ("temperature-str", "POST", G, dict(json={"prompt": "a", "sampling_params": {"temperature": "hot"}}), 400,
     "sampling_params.temperature", ["temperature"]),
    ("max-tokens-str", "POST", C, dict(json={"prompt": "a", "max_tokens": "10"}), 400, "max_tokens", ["max_tokens"]),
    ("messages-str", "POST", CHAT, dict(json={"messages": "hi"}), 400, "messages", ["messages"]),
    ("token-ids-str", "POST", G, dict(json={"prompt_token_ids": ["a"]}), 400, "prompt_token_ids[0]",
     ["prompt_token_ids"]),
    ("stream-str", "POST", G, dict(json={"prompt": "a", "stream": "yes"}), 400, "stream", ["stream"]),
    ("request-ids-int", "POST", "/abort_requests", dict(json={"request_ids": 3}, headers=ADMIN), 400, "request_ids",
     ["request_ids"]),
    ("not-json", "POST", G, dict(content=b"{oops", headers={"Content-Type": "application/json"}), 400, None, ["JSON"]),
    # integers msgpack cannot carry to the engine core (once a 500 OverflowError)
    ("seed-2-64", "POST", G, dict(json={"prompt": "a", "sampling_params": {"seed": 1 << 64}}), 400,
     "sampling_params.seed", ["range"]),
    ("max-tokens-huge", "POST", C, dict(json={"prompt": "a", "max_tokens": 1 << 70}), 400, "max_tokens", ["range"]),
    ("stop-token-huge", "POST", CHAT, dict(json={"messages": MSGS, "stop_token_ids": [1, -(1 << 64)]}), 400,
     "stop_token_ids[1]", ["range"]),
    ("rpc-arg-huge", "POST", "/collective_rpc", dict(json={"method": "ping", "args": [1 << 65]}, headers=ADMIN), 400,
     "args[0]", ["range"]),
    ("ipc-handle-huge", "POST", "/update_weights_from_ipc",
     dict(json={"handles": {"kind": "shm", "size": 1 << 66}}, headers=ADMIN), 400, "handles.size", ["range"]),
    # missing fields
    ("no-prompt", "POST", C, dict(json={"max_tokens": 3}), 400, "prompt", ["required"]),
    ("no-messages", "POST", CHAT, dict(json={}), 400, "messages", ["required"]),
    ("no-prompt-generate", "POST", G, dict(json={"sampling_params": {}}), 400, "prompt", ["prompt"]),
    ("no-method", "POST", "/collective_rpc", dict(json={}, headers=ADMIN), 400, "method", ["required"]),
    ("no-path", "POST", "/update_weights_from_disk", dict(json={}, headers=ADMIN), 400, "path", ["required"]),
    ("no-init-info", "POST", "/init_weight_transfer_engine", dict(json={}, headers=ADMIN), 400, "init_info",
     ["required"]),
    # bad sampling values (the engine's checks name the field)
    ("top-p", "POST", G, dict(json={"prompt": "a", "sampling_params": {"top_p": 2}}), 400, "sampling_params.top_p",
     ["top_p"]),
    ("n-zero", "POST", C, dict(json={"prompt": "a", "n": 0}), 400, "n", ["n"]),
    ("negative-temperature", "POST", C, dict(json={"prompt": "a", "temperature": -1}), 400, "temperature",
     ["temperature"]),
    ("logprobs-too-many", "POST", C, dict(json={"prompt": "a", "logprobs": 50}), 400, "logprobs", ["logprobs"]),
    ("max-tokens-zero", "POST", CHAT, dict(json={"messages": MSGS, "max_tokens": 0}), 400, "max_tokens",
     ["max_tokens"]),
    ("greedy-n", "POST", G, dict(json={"prompt": "a", "sampling_params": {"n": 2, "temperature": 0}}), 400,
     "sampling_params.n", ["n"]),
    ("penalty", "POST", C, dict(json={"prompt": "a", "presence_penalty": 0.5}), 400, "presence_penalty",
     ["presence_penalty"]),
    ("typo-field", "POST", G, dict(json={"prompt": "a", "sampling_params": {"max_token": 3}}), 400,
     "sampling_params.max_token", ["unknown", "max_token"]),
    ("top-logprobs-alone", "POST", CHAT, dict(json={"messages": MSGS, "top_logprobs": 2}), 400, "top_logprobs",
     ["logprobs"]),
    # prompts the engine cannot take
    ("too-long-ids", "POST", G, dict(json={"prompt_token_ids": [1] * (MAX_MODEL_LEN + 5)}), 400, "prompt_token_ids",
     ["max_model_len"]),
    ("too-long-text", "POST", C, dict(json={"prompt": "hello " * (MAX_MODEL_LEN + 5)}), 400, "prompt",
     ["max_model_len"]),
    ("out-of-vocab", "POST", G, dict(json={"prompt_token_ids": [[1, 2], [10 ** 9]]}), 400, "prompt_token_ids",
     ["prompt_token_ids[1]", "vocabulary"]),
    ("empty-prompt", "POST", G, dict(json={"prompt": ""}), 400, "prompt", ["empty"]),
    ("wrong-model", "POST", C, dict(json={"prompt": "a", "model": "gpt-9"}), 404, "model", ["gpt-9"]),
    # unknown routes and methods
    ("unknown-route", "GET", "/v2/nothing", {}, 404, None, ["/v2/nothing"]),
    ("wrong-method", "GET", G, {}, 405, None, ["GET"]),
    # control values
    ("pause-mode", "POST", "/pause", dict(params={"mode": "later"}, headers=ADMIN), 400, "mode", ["mode"]),
    ("sleep-level", "POST", "/sleep", dict(params={"level": 3}, headers=ADMIN), 400, "level", ["level"]),
    ("wake-tags", "POST", "/wake_up", dict(params={"tags": "gpu"}, headers=ADMIN), 400, "tags", ["tags"]),
    ("rpc-unregistered", "POST", "/collective_rpc", dict(json={"method": "__class__"}, headers=ADMIN), 403, "method",
     ["not registered"]),
    ("world-size", "POST", "/init_weight_transfer_engine",
     dict(json={"init_info": {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 3,
                              "rank_offset": 3}}, headers=ADMIN),
     400, "init_info.world_size", ["world_size"]),
    ("bad-host", "POST", "/init_weight_transfer_engine",  # (the schema fuzz's find: was a 500)
     dict(json={"init_info": {"master_address": "\U00106087", "master_port": 1, "world_size": 2}}, headers=ADMIN),
     400, "init_info.master_address", ["host name"]),
    ("bad-port", "POST", "/init_weight_transfer_engine",
     dict(json={"init_info": {"master_address": "127.0.0.1", "master_port": 0, "world_size": 2}}, headers=ADMIN),
     400, "init_info.master_port", ["master_port"]),
    ("disk-path", "POST", "/update_weights_from_disk", dict(json={"path": "/no/such/ckpt"}, headers=ADMIN), 400,
     "path", ["/no/such/ckpt"]),
    ("save-relative", "POST", "/save_weights", dict(json={"path": "ckpt/step-1"}, headers=ADMIN), 400, "path",
     ["absolute", "ckpt/step-1"]),
    ("ipc-handles", "POST", "/update_weights_from_ipc", dict(json={"handles": {"kind": "x"}}, headers=ADMIN), 400,
     "handles", ["IPC handles must be"]),
    ("version-str", "POST", "/finish_weight_update", dict(json={"weight_version": "v1"}, headers=ADMIN), 400,
     "weight_version", ["integer"]),
    # calls in the wrong state
    ("finish-without-start", "POST", "/finish_weight_update", dict(json={}, headers=ADMIN), 409, None,
     ["no weight update"]),
    ("update-without-group", "POST", "/update_weights", dict(json={"update_info": {}}, headers=ADMIN), 409, None,
     ["init_weight_transfer"]),
    # keys and sizes
    ("no-key", "POST", G, dict(json={"prompt": "a"}, headers={"Authorization": ""}), 401, "authorization", ["key"]),
    ("wrong-key", "GET", "/v1/models", dict(headers={"Authorization": "Bearer nope"}), 401, "authorization", ["key"]),
    ("user-key-on-admin-route", "POST", "/pause", dict(headers=USER), 403, "authorization", ["admin"]),
    ("oversized-body", "POST", G, dict(content=b"x" * (MAX_BODY_BYTES + 1),
                                        headers={"Content-Type": "application/json"}), 413, None, ["limit"]),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, case):
    _, method, path, kwargs, status, param, words = case
    kwargs = dict(kwargs)
    headers = {k: v for k, v in {**USER, **kwargs.pop("headers", {})}.items() if v}
    resp = http.request(method, path, headers=headers, **kwargs)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param"}
    assert err["param"] == param, err
    for w in words:
        assert w.lower() in err["message"].lower(), err


def test_still_serves_after_bad_requests(http):
    for case in CASES[:5]:  # and a few more for good measure, interleaved with a good one
        http.request(case[1], case[2], **{k: v for k, v in case[3].items() if k != "headers"}, headers=USER)
    resp = http.post("/generate", json={"prompt": "Hello", "sampling_params": {"max_tokens": 3, "temperature": 0}},
                     headers=USER)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["results"][0]["outputs"][0]["token_ids"]) == 3
    assert http.get("/health").json() == {"status": "ok"}


def test_every_route_but_the_probes_needs_the_key(server):
    routes = list(iter_routes(build_app(engine=None)))
    assert len(routes) > 25
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for path, methods, tags in routes:
            method = sorted(methods - {"HEAD"})[0]
            resp = anon.request(method, path, json={})
            if path in OPEN_PATHS:  # /health and /ready: an orchestrator's probes
                assert resp.status_code == 200, (path, resp.text)
                continue
            assert resp.status_code == 401, (method, path, resp.status_code, resp.text)
            assert resp.json()["error"]["type"] == "authentication_error"
            if "admin" in tags:  # the user key is not enough
                resp = anon.request(method, path, json={}, headers=USER)
                assert resp.status_code == 403, (method, path, resp.text)
