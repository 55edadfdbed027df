"""Multi-turn sessions over HTTP (rollout/api/sessions.py) on the real server (default model,
float32): token-exact against one request over the whole conversation, the rules for bad turns,
timeouts, client disconnects, pause modes and weight pushes.
"""
import asyncio
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from engine.sampling_params import SamplingParams
from rollout.api.errors import APIError
from rollout.api.session_store import Sessions
from rollout.client import AsyncRolloutClient, RolloutAPIError, RolloutClient
from tests.rollout.conftest import ADMIN_KEY, API_KEY, MAX_MODEL_LEN, start_server, stop_server

GREEDY = {"temperature": 0.0, "max_tokens": 12, "logprobs": 0}


def chat_ids(client, text: str) -> list[int]:
    return client.tokenize(messages=[{"role": "user", "content": text}])


def test_turns_equal_one_request_over_the_conversation(client):
    """Three turns (a question, a tool answer, a follow-up) equal, token for token, one greedy
    request over everything before each turn's output; logprobs agree too."""
    first = chat_ids(client, "Name a fruit.")
    tool = client.tokenize(prompt="<|im_end|>\n<|im_start|>user\nTool says: 42. Repeat the number.<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    more = client.tokenize(prompt="<|im_end|>\n<|im_start|>user\nAnd twice that?<|im_end|>\n<|im_start|>assistant\n")
    with client.session() as s:
        outs = [s.generate(first, GREEDY), s.generate(tool, GREEDY), s.generate(more, GREEDY)]
        assert [o.prompt_token_ids for o in outs] == [first, tool, more]
        assert s.token_ids == first + outs[0].token_ids + tool + outs[1].token_ids + more + outs[2].token_ids
        assert sum(s.generated) == sum(len(o.token_ids) for o in outs)
        opened = {x["session_id"]: x for x in client.list_sessions()}
        assert opened[s.id]["num_turns"] == 3 and opened[s.id]["num_tokens"] == len(s.token_ids)
    context = []
    for o in outs:
        context += o.prompt_token_ids
        ref = client.generate(context, GREEDY)[0]
        assert o.token_ids == ref.token_ids, "a session turn differs from one request over the conversation"
        assert max(abs(a - b) for a, b in zip(o.logprobs, ref.logprobs)) < 1e-4
        context += o.token_ids
    assert s.id not in {x["session_id"] for x in client.list_sessions()}


def test_bad_turns_are_refused_and_lose_nothing(client):
    with client.session() as s:
        s.generate([1, 2, 3], GREEDY)
        with pytest.raises(RolloutAPIError) as e:
            s.generate([4], dict(GREEDY, n=2, temperature=1.0))
        assert e.value.status == 400 and e.value.param == "sampling_params.n"
        with pytest.raises(RolloutAPIError) as e:
            s.generate([4], dict(GREEDY, stop=["."]))
        assert e.value.status == 400 and e.value.param == "sampling_params.stop"
        with pytest.raises(RolloutAPIError) as e:  # would overflow the context: the session stays as it was
            s.generate([5] * (MAX_MODEL_LEN - len(s.token_ids)), GREEDY)
        assert e.value.status == 400 and e.value.param == "prompt" and "context" in e.value.message
        out = s.generate([6, 7], GREEDY)  # the session still serves
        assert len(out.token_ids) == 12
    with pytest.raises(RolloutAPIError) as e:
        client.generate_turn("no-such-session", [1, 2], GREEDY)
    assert e.value.status == 404 and e.value.param == "session_params.id"
    sid = client.open_session()
    try:
        with pytest.raises(RolloutAPIError) as e:
            client.open_session(sid)
        assert e.value.status == 409
        body = {"prompt_token_ids": [[1, 2], [3, 4]], "session_params": {"id": sid}}
        r = httpx.post(client.url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400 and "batch" in r.json()["error"]["message"]
        first = {"messages": [{"role": "user", "content": "hi"}], "session_params": {"id": sid},
                 "sampling_params": GREEDY}
        assert httpx.post(client.url + "/generate", json=first, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60).status_code == 200
        r = httpx.post(client.url + "/generate", json=first, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        client.close_session(sid)
    with pytest.raises(RolloutAPIError) as e:
        client.close_session(sid)
    assert e.value.status == 404


def test_one_turn_at_a_time(client, server):
    sid = client.open_session()
    client.generate_turn(sid, [1, 2, 3], dict(GREEDY, max_tokens=2))
    results = {}

    def long_turn():
        results["long"] = client.generate_turn(sid, [4], {"max_tokens": 200, "ignore_eos": True})

    t = threading.Thread(target=long_turn)
    t.start()
    deadline = time.monotonic() + 30
    while not any(x["busy"] for x in client.list_sessions() if x["session_id"] == sid):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(RolloutAPIError) as e:
        client.generate_turn(sid, [5], GREEDY)
    assert e.value.status == 409
    with pytest.raises(RolloutAPIError) as e:
        client.close_session(sid)
    assert e.value.status == 409
    t.join(300)  # 200 tokens: minutes on a loaded 2-core machine
    assert len(results["long"].token_ids) == 200
    assert client.close_session(sid)["num_turns"] == 2


def test_idle_sessions_time_out_and_disconnects_end_them(client, server):
    sid = client.open_session(timeout_s=0.5)
    client.generate_turn(sid, [1, 2, 3], dict(GREEDY, max_tokens=2))
    time.sleep(2.5)
    assert sid not in {x["session_id"] for x in client.list_sessions()}
    with pytest.raises(RolloutAPIError) as e:
        client.generate_turn(sid, [4], GREEDY)
    assert e.value.status == 404 and "idle for more than 0.5 s" in e.value.message
    # a turn whose client goes away ends the session (the context holds tokens the client never saw)
    sid = client.open_session()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", timeout=0.3, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt_token_ids": [1, 2, 3], "session_params": {"id": sid},
                         "sampling_params": {"max_tokens": 400, "ignore_eos": True}})
    deadline = time.monotonic() + 30
    while sid in {x["session_id"] for x in client.list_sessions()}:
        assert time.monotonic() < deadline, "a session whose client went away mid-turn stayed open"
        time.sleep(0.05)
    assert client.health()


def test_pauses_and_pushes_with_open_sessions(client, model_path):
    """keep / wait pauses leave sessions open (a turn sent while paused runs after resume), a
    weight push labels later turns with the new version, an abort pause ends them."""
    with client.session() as s:
        s.generate([1, 2, 3], GREEDY)
        client.pause(mode="keep")
        held = {}
        t = threading.Thread(target=lambda: held.setdefault("out", s.generate([4, 5], GREEDY)))
        t.start()
        time.sleep(0.5)
        assert "out" not in held, "a turn ran while generation was paused"
        version = client.weight_version() + 1
        client.push_weights_from_disk(model_path, version=version)
        client.resume()
        t.join(60)
        assert held["out"].weight_versions == [version] * 12
        client.pause(mode="wait")
        client.resume()
        assert s.generate([6], GREEDY).weight_versions == [version] * 12
        client.pause(mode="abort")
        client.resume()
        with pytest.raises(RolloutAPIError) as e:
            s.generate([7], GREEDY)
        assert e.value.status == 409 and "aborted" in e.value.message
    assert s.id not in {x["session_id"] for x in client.list_sessions()}


def test_async_client_sessions(server):
    async def main():
        async with AsyncRolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
            async def one(i):
                async with await c.session() as s:
                    a = await s.generate([1, 2, 3 + i], GREEDY)
                    b = await s.generate([9, 9], GREEDY)
                    return s.token_ids, a, b

            return await asyncio.gather(*(one(i) for i in range(4)))

    for i, (ids, a, b) in enumerate(asyncio.run(main())):
        assert ids == [1, 2, 3 + i] + a.token_ids + [9, 9] + b.token_ids


def test_a_session_across_sleep_and_wake(client):
    """Sleep (mode keep) frees an idle session's KV; after the wake-up its next turn recomputes it
    and still equals one request over the whole conversation."""
    with client.session() as s:
        first = s.generate([1, 2, 3, 4], GREEDY)
        client.sleep(level=1, mode="keep")
        assert client.is_sleeping()
        client.wake_up()
        second = s.generate([5, 6], GREEDY)
        context = [1, 2, 3, 4] + first.token_ids + [5, 6]
        assert second.token_ids == client.generate(context, GREEDY)[0].token_ids


OWN_MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def own_server():
    """A server of their own for the tests below, which check that the engine runs nothing and holds
    no KV once their sessions end: a session another test left open (one that failed midway) would
    spoil that on the shared server. A short context makes filling it cheap."""
    s = start_server("--max-model-len", str(OWN_MAX_MODEL_LEN))  # (the last --max-model-len wins)
    yield s
    code = stop_server(s)
    assert code == 0, f"rollout serve exited with {code}:\n{s.log()}"


@pytest.fixture(scope="module")
def own_client(own_server) -> RolloutClient:
    with RolloutClient(own_server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
        yield c


def engine_load(client) -> dict:
    """The engine's running requests and KV usage, read from /metrics."""
    text = client.metrics()
    found = {}
    for name in ("num_requests_running", "kv_cache_usage_ratio"):
        m = re.search(rf"^rollout_{name} ([0-9.e+-]+)$", text, re.M)
        assert m, f"rollout_{name} missing from /metrics"
        found[name] = float(m.group(1))
    return found


def engine_idle(client, timeout_s: float = 10.0) -> bool:
    """Wait until the engine runs no request and holds no KV block (aborts reach the core
    asynchronously, hence the wait)."""
    deadline = time.monotonic() + timeout_s
    while any(engine_load(client).values()):
        if time.monotonic() > deadline:
            print(f"engine load: {engine_load(client)}")
            return False
        time.sleep(0.05)
    return True


def test_concurrent_turns_one_runs_the_rest_get_409(own_client, own_server):
    """Turns sent at once on a session that already had one: exactly one runs, the others get 409
    and change nothing; the session goes on token-exact and leaves no engine request behind."""
    client, headers = own_client, {"Authorization": f"Bearer {API_KEY}"}
    sid = client.open_session()
    context = [1, 2, 3]
    context += client.generate_turn(sid, context, GREEDY).token_ids

    async def burst(round_: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=headers) as http:
            bodies = [{"prompt_token_ids": [20 + round_, 40 + k], "session_params": {"id": sid},
                       "sampling_params": GREEDY} for k in range(4)]
            return await asyncio.gather(*(http.post(own_server.url + "/generate", json=b) for b in bodies))

    for round_ in range(5):
        rs = asyncio.run(burst(round_))
        codes = [r.status_code for r in rs]
        assert sorted(codes) == [200, 409, 409, 409], [(r.status_code, r.text[:300]) for r in rs]
        for r in rs:
            if r.status_code == 409:
                assert r.json()["error"]["param"] == "session_params.id", r.text
        won = rs[codes.index(200)].json()["results"][0]
        context += won["prompt_token_ids"]
        ref = client.generate(context, GREEDY)[0]
        assert won["outputs"][0]["token_ids"] == ref.token_ids, f"round {round_}: the winning turn is not token-exact"
        context += won["outputs"][0]["token_ids"]
        assert engine_load(client)["num_requests_running"] == 0, "a request kept running after the burst"
    last = client.generate_turn(sid, [7, 8], GREEDY)  # the session goes on
    assert last.token_ids == client.generate(context + [7, 8], GREEDY)[0].token_ids
    assert client.close_session(sid)["num_turns"] == 7
    assert engine_idle(client), "the session's engine request outlived it"


def test_a_turn_that_fills_the_context_closes_the_session(own_client):
    """A turn cut off at max_model_len leaves no room for another: the session closes at once (its
    KV freed), its answer says so, and the next turn or close says why."""
    client = own_client
    sid = client.open_session()
    prompt = [(17 * i) % 4000 + 100 for i in range(OWN_MAX_MODEL_LEN - 20)]
    r = httpx.post(client.url + "/generate", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                   json={"prompt_token_ids": prompt, "session_params": {"id": sid},
                         "sampling_params": {"temperature": 0.0, "max_tokens": 100, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()["results"][0]["outputs"][0]
    assert out["finish_reason"] == "length" and len(prompt) + len(out["token_ids"]) == OWN_MAX_MODEL_LEN
    assert "filled the context" in r.json()["session"]["closed"]
    assert sid not in {x["session_id"] for x in client.list_sessions()}, "a full session kept its slot"
    assert engine_idle(client), "a full session kept its KV"
    for call in (lambda: client.generate_turn(sid, [1], GREEDY), lambda: client.close_session(sid)):
        with pytest.raises(RolloutAPIError) as e:
            call()
        assert e.value.status == 404 and "filled the context" in e.value.message, e.value.message


def test_a_pause_in_mode_abort_frees_every_session(own_client):
    """Pause mode abort ends an idle session, one in the middle of a turn and one whose context is
    full: their engine requests end and free their KV; the next turn says why."""
    client = own_client
    with client.session() as idle, client.session() as busy, client.session() as full:
        idle.generate([1, 2, 3], GREEDY)
        full.generate([9] * (OWN_MAX_MODEL_LEN - 4), {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True})
        busy.generate([4, 5, 6], GREEDY)
        held = {}
        t = threading.Thread(target=lambda: held.setdefault(
            "out", busy.generate([7], {"max_tokens": 200, "ignore_eos": True})))
        t.start()
        deadline = time.monotonic() + 30
        while not any(x["busy"] for x in client.list_sessions() if x["session_id"] == busy.id):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        client.pause(mode="abort")
        try:
            t.join(60)
            assert held["out"].finish_reason == "abort" and len(held["out"].token_ids) < 200
            assert engine_idle(client), "a pause in mode abort left a session's engine request holding KV"
        finally:
            client.resume()
        for s, why in ((idle, "abort"), (busy, "abort"), (full, "")):
            with pytest.raises(RolloutAPIError) as e:
                s.generate([8], GREEDY)
            assert e.value.status in (404, 409) and why in e.value.message, e.value.message
    assert engine_idle(client)

def test_a_claim_whose_turn_never_starts_lets_go():
    """start_turn claims the session synchronously (so concurrent turns get 409); if its turn is
    dropped before it ever ran (the client left before the response began), the claim goes with
    it instead of leaving the session busy for good. No server: nothing reaches an engine."""
    state = SimpleNamespace(engine=SimpleNamespace(max_model_len=64), check_can_generate=lambda: None)
    sessions = Sessions(state, default_timeout_s=60.0, max_sessions=4)
    s = sessions.create(None, None)
    turn = sessions.start_turn(s, [1, 2], SamplingParams(max_tokens=2))
    assert s.busy
    with pytest.raises(APIError) as e:
        sessions.start_turn(s, [3], SamplingParams(max_tokens=2))
    assert e.value.status == 409
    del turn
    assert not s.busy and s.stream is None and s.inputs.empty()
    sessions.start_turn(s, [3], SamplingParams(max_tokens=2))
