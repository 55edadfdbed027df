"""Multi-turn sessions over HTTP (rollout/api/sessions.py) on the real server (default model,
float32): token-exact against one request over the whole conversation, the rules for bad turns,
timeouts, client disconnects, pause modes and weight pushes.
"""
import asyncio
import threading
import time

import httpx
import pytest

from rollout.client import AsyncRolloutClient, RolloutAPIError
from tests.rollout.conftest import ADMIN_KEY, API_KEY, MAX_MODEL_LEN

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
    t.join(60)
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
