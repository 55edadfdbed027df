"""/abort_requests with wait: true over the real server (the session's float32 default model): the
manifest holds, for every aborted request, exactly what its own caller received (non-streaming and
streaming /generate, n > 1, a batch aborted by its id), requests that end by themselves while the
abort lands keep their real finish reason, unknown and already-ended ids are listed, an abort
during a pause in mode keep answers at once with the frozen tokens; the timeout path and the
record's delta merge as units. A slow test covers two data-parallel replicas."""
import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from engine.frontend.outputs import CompletionOutput, RequestOutput
from rollout.api.abort_manifest import RecentlyEnded, RequestRecord, abort_with_manifest, expand_ids
from rollout.client import GenerateOutput, RolloutClient
from tests.rollout.conftest import ADMIN_KEY, API_KEY, start_server, stop_server

LONG = {"temperature": 1.0, "max_tokens": 400, "ignore_eos": True, "logprobs": 2, "seed": 7}
PROMPT = "Write a long story about a dragon."


def generate_in_thread(client, prompts, params, request_id, box, key):
    def run():
        try:
            box[key] = client.generate(prompts, params, request_id=request_id)
        except Exception as e:  # noqa: BLE001 - surfaced by the test
            box[key] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def stream_in_thread(client, params, request_id, box, key, started: threading.Event):
    """A streaming /generate; box[key]: the caller's view (all deltas of sample 0 merged)."""
    def run():
        deltas = []
        try:
            for _, ds in client.generate_stream(PROMPT, params, request_id=request_id):
                deltas.extend(ds)
                if sum(len(d.token_ids) for d in deltas) >= 2:
                    started.set()
        except Exception as e:  # noqa: BLE001
            box[key] = e
            started.set()
            return
        box[key] = GenerateOutput(token_ids=[t for d in deltas for t in d.token_ids],
                                  logprobs=[x for d in deltas for x in d.logprobs],
                                  weight_versions=[v for d in deltas for v in d.weight_versions],
                                  text="".join(d.text for d in deltas), finish_reason=deltas[-1].finish_reason,
                                  top_logprobs=[x for d in deltas for x in d.top_logprobs])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def same(entry: GenerateOutput, got: GenerateOutput) -> None:
    """The manifest's entry is what the caller received, field for field."""
    assert entry.token_ids == got.token_ids
    assert entry.logprobs == got.logprobs and len(entry.logprobs) == len(entry.token_ids)
    assert entry.top_logprobs == got.top_logprobs
    assert entry.weight_versions == got.weight_versions
    assert entry.finish_reason == got.finish_reason
    assert entry.text == got.text


def wait_in_flight(client, n: int) -> None:
    """Until the server holds `n` requests (an abort finds only those that arrived)."""
    deadline = time.monotonic() + 120
    while client.server_info()["requests_in_flight"] < n:
        assert time.monotonic() < deadline, f"not {n} requests in flight"
        time.sleep(0.05)


def test_abort_all_wait_returns_what_every_caller_got(client):
    box, started = {}, [threading.Event() for _ in range(2)]
    threads = [generate_in_thread(client, PROMPT, dict(LONG, seed=i), f"plain{i}", box, f"plain{i}")
               for i in range(2)]
    threads.append(generate_in_thread(client, PROMPT, dict(LONG, n=2), "multi", box, "multi"))
    threads += [stream_in_thread(client, dict(LONG, seed=10 + i), f"streamed{i}", box, f"streamed{i}", started[i])
                for i in range(2)]
    assert all(e.wait(120) for e in started), "no token within 120 s"
    wait_in_flight(client, 5)  # both streams have tokens and every request is there
    manifest = client.abort_requests(wait=True, return_prompt_token_ids=True)
    for t in threads:
        t.join(60)
    assert manifest.complete and manifest.aborted == 5 and not manifest.not_found
    by_id = {(e.request_id, e.index): e for e in manifest.requests}
    # a single prompt through the client is a batch of one: "<id>-0"; n=2: one entry per sample
    assert set(by_id) == {("plain0-0", 0), ("plain1-0", 0), ("multi-0", 0), ("multi-0", 1), ("streamed0-0", 0),
                          ("streamed1-0", 0)}, sorted(by_id)
    for i in range(2):
        same(by_id[f"plain{i}-0", 0], box[f"plain{i}"][0])
        same(by_id[f"streamed{i}-0", 0], box[f"streamed{i}"])
        assert by_id[f"plain{i}-0", 0].prompt_token_ids == box[f"plain{i}"][0].prompt_token_ids
    for j in range(2):
        same(by_id["multi-0", j], box["multi"][0][j])
    assert all(e.finish_reason == "abort" for e in manifest.requests)
    assert sum(len(e.token_ids) for e in manifest.requests) > 0
    assert all(0 < len(e.token_ids) < LONG["max_tokens"] for k, e in by_id.items() if k[0].startswith("streamed"))
    # nothing is left in flight: the answer came after every request ended
    assert client.server_info()["requests_in_flight"] == 0


def test_abort_a_batch_by_its_id_with_wait(client):
    box, started = {}, threading.Event()
    t = generate_in_thread(client, [PROMPT, "Count to a thousand:"], LONG, "batch", box, "batch")
    s = stream_in_thread(client, LONG, "bystander", box, "bystander", started)
    assert started.wait(120)
    manifest = client.abort_requests(["batch", "no-such-request"], wait=True)
    t.join(60)
    assert manifest.aborted == 2 and manifest.not_found == ["no-such-request"]
    assert [e.request_id for e in sorted(manifest.requests, key=lambda e: e.request_id)] == ["batch-0", "batch-1"]
    for e in manifest.requests:
        same(e, box["batch"][int(e.request_id[-1])])
        assert e.finish_reason == "abort"
    assert s.is_alive(), "aborting a batch by id aborted another request"
    assert client.abort_requests(["bystander"]) == 1  # (wait: false keeps today's answer: a count)
    s.join(60)
    assert box["bystander"].finish_reason == "abort"
    # ids that ended a moment ago are told apart from ids never seen
    later = client.abort_requests(["batch", "bystander", "never"], wait=True)
    assert later.already_finished == ["batch", "bystander"] and later.not_found == ["never"] and not later.requests


def test_abort_while_requests_finish_by_themselves(client):
    """Short requests end on their own while the abort lands (started concurrently with it): each
    one in the manifest has its real finish reason and exactly its caller's tokens; long ones
    are all in it, aborted."""
    box, started = {}, [threading.Event() for _ in range(2)]
    shorts, manifests, longs = [], [], []
    aborter = threading.Thread(target=lambda: manifests.append(client.abort_requests(wait=True)), daemon=True)
    for i in range(12):  # staggered: some end before the abort, some while it lands, some come after it
        shorts.append(generate_in_thread(client, PROMPT, dict(LONG, max_tokens=1 + i % 3, seed=i), f"short{i}", box,
                                         f"short{i}"))
        time.sleep(0.5)
        if i == 7:
            # the longs start just before the abort: still running when it lands, on any machine
            longs = [stream_in_thread(client, dict(LONG, seed=j), f"long{j}", box, f"long{j}", started[j])
                     for j in range(2)]
            assert all(e.wait(120) for e in started)
            aborter.start()
    for t in [aborter, *longs, *shorts]:
        t.join(120)
    [manifest] = manifests
    assert manifest.complete
    by_id = {e.request_id: e for e in manifest.requests}
    for i in range(2):
        same(by_id[f"long{i}-0"], box[f"long{i}"])
        assert by_id[f"long{i}-0"].finish_reason == "abort"
    for i in range(12):
        got = box[f"short{i}"][0]
        assert got.finish_reason in ("length", "abort")
        if f"short{i}-0" in by_id:  # in flight when the abort landed
            same(by_id[f"short{i}-0"], got)
        else:  # ended before it, or arrived after it: never aborted
            assert got.finish_reason == "length"


def test_abort_with_wait_during_a_keep_pause(client):
    """Requests frozen by pause(keep) and requests held by the pause are aborted at once: the
    manifest comes without waiting for a resume, with the tokens generated before the pause
    (held ones: none); the pause stays until /resume."""
    box, started = {}, threading.Event()
    frozen = stream_in_thread(client, LONG, "frozen", box, "frozen", started)
    assert started.wait(120)
    client.pause(mode="keep")
    try:
        held = generate_in_thread(client, PROMPT, LONG, "held", box, "held")
        wait_in_flight(client, 2)  # the held one arrived
        t0 = time.monotonic()
        manifest = client.abort_requests(wait=True, timeout_s=30)
        assert time.monotonic() - t0 < 10, "the abort waited for the pause"
        frozen.join(60)
        held.join(60)
        by_id = {e.request_id: e for e in manifest.requests}
        same(by_id["frozen-0"], box["frozen"])
        assert by_id["frozen-0"].finish_reason == "abort" and len(by_id["frozen-0"].token_ids) >= 2
        same(by_id["held-0"], box["held"][0])
        assert by_id["held-0"].token_ids == [] and by_id["held-0"].finish_reason == "abort"
        assert client.is_paused()
    finally:
        client.resume()


def test_abort_with_wait_of_a_session_turn(client):
    """A session turn in the middle of generating: its entry holds the turn's tokens, as the turn's
    caller got them (the session ends, as any abort ends it)."""
    with client.session() as s:
        s.generate(client.tokenize(prompt=PROMPT), dict(LONG, max_tokens=3))
        box = {}

        def turn():
            box["out"] = s.generate(client.tokenize(prompt=" And then?"), LONG)

        t = threading.Thread(target=turn, daemon=True)
        base = _tokens(client)
        t.start()
        deadline = time.monotonic() + 120
        while _tokens(client) < base + 2:  # the turn is generating
            assert time.monotonic() < deadline
            time.sleep(0.1)
        manifest = client.abort_requests(wait=True)
        t.join(60)
    [entry] = manifest.requests
    assert entry.request_id == f"session-{s.id}"
    same(entry, box["out"])
    assert entry.finish_reason == "abort" and len(entry.token_ids) > 0


@pytest.mark.parametrize("body, param", [({"all": True, "request_ids": ["x"]}, "all"),
                                         ({"wait": True, "timeout_s": 0}, "timeout_s"),
                                         ({"wait": True, "timeout_s": 601}, "timeout_s"),
                                         ({"wait": "yes"}, "wait")])
def test_bad_abort_bodies_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/abort_requests", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- units: no server -------------------------------------------------------------------------------
def _output(rid, tokens, finished=False, reason=None):
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "x" * len(tokens), list(tokens), [-0.5] * len(tokens),
                                                              finish_reason=reason, weight_versions=[3] * len(tokens))],
                         finished)


def test_record_merges_deltas_without_touching_the_callers_outputs():
    record = RequestRecord("r", delta=True, n=1)
    first, second = _output("r", [5, 6]), _output("r", [7], True, "abort")
    record.see(first)
    record.see(second)
    assert first.outputs[0].token_ids == [5, 6], "the caller's output was changed"
    [entry] = record.entries(prompt_token_ids=True)
    assert entry["token_ids"] == [5, 6, 7] and entry["logprobs"] == [-0.5] * 3 and entry["weight_versions"] == [3] * 3
    assert entry["finish_reason"] == "abort" and entry["prompt_token_ids"] == [1, 2]


def test_abort_wait_times_out_with_the_pending_ids():
    async def run():
        done, stuck = RequestRecord("done", False, 1), RequestRecord("stuck", False, 1)
        done.see(_output("done", [9], True, "abort"))
        done.ended.set()
        aborted = []

        async def abort(ids):
            aborted.extend(ids)

        state = SimpleNamespace(in_flight={"done": 0.0, "stuck": 0.0}, records={"done": done, "stuck": stuck},
                                engine=SimpleNamespace(abort=abort), recently_ended=RecentlyEnded())
        t0 = time.monotonic()
        answer = await abort_with_manifest(state, None, 0.3, False)
        return answer, aborted, time.monotonic() - t0

    answer, aborted, took = asyncio.run(run())
    assert aborted == ["done", "stuck"] and 0.3 <= took < 5
    assert answer["status"] == "timed_out" and answer["pending"] == ["stuck"] and "timeout_s" in answer["message"]
    assert [e["request_id"] for e in answer["requests"]] == ["done"]


def test_ids_name_requests_and_batches():
    in_flight = {"a": 0, "b-0": 0, "b-1": 0, "c": 0}
    assert expand_ids(in_flight, ["b", "a", "zz", "b-1"]) == (["b-0", "b-1", "a"], {"zz"})
    recent = RecentlyEnded(size=2)
    for rid in ("old", "x-0", "y"):
        recent.add(rid)
    assert recent.matching(["old", "x", "y", "z"]) == {"x", "y"}


# ---- two data-parallel replicas ---------------------------------------------------------------------
@pytest.mark.slow
def test_abort_wait_covers_every_replica():
    """-dp 2: requests pinned to both replicas (X-data-parallel-rank) are all in one manifest,
    each equal to its caller's answer."""
    server = start_server("--data-parallel-size", "2")
    try:
        box = {}

        def run(i):
            body = {"prompt": PROMPT, "sampling_params": dict(LONG, seed=i), "request_id": f"dp{i}"}
            r = httpx.post(server.url + "/generate", json=body, timeout=300,
                           headers={"Authorization": f"Bearer {API_KEY}", "X-data-parallel-rank": str(i % 2)})
            box[i] = GenerateOutput.from_json(r.json()["results"][0], r.json()["results"][0]["outputs"][0])

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
            deadline = time.monotonic() + 180
            while c.server_info()["requests_in_flight"] < 4 or _tokens(c) < 8:
                assert time.monotonic() < deadline, "the requests did not start"
                time.sleep(0.2)
            manifest = c.abort_requests(wait=True)
        for t in threads:
            t.join(60)
        assert manifest.complete and manifest.aborted == 4
        by_id = {e.request_id: e for e in manifest.requests}
        assert set(by_id) == {f"dp{i}" for i in range(4)}
        for i in range(4):
            same(by_id[f"dp{i}"], box[i])
            assert box[i].finish_reason == "abort"
        assert sum(len(e.token_ids) for e in manifest.requests) > 0
    finally:
        assert stop_server(server) == 0


def _tokens(client) -> float:
    return sum(float(line.split()[-1]) for line in client.metrics().splitlines()
               if line.startswith("rollout_generation_tokens_total"))
