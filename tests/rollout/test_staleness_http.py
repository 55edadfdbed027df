"""Staleness enforced by the server, over HTTP (engine/core/staleness.py): requests with
max_weight_staleness that a real weight push (a perturbed checkpoint from disk, while they run)
leaves too stale end with finish_reason "stale" or restart under the new weights; /metrics counts
them; min_weight_version waits for the push. Bad values are a 400 naming the field."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from safetensors.torch import save_file

from rollout.client import RolloutClient
from tests.engine.perturb import perturbed_state
from tests.rollout.conftest import ADMIN_KEY, API_KEY, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
GREEDY = {"temperature": 0, "max_tokens": 48, "ignore_eos": True, "logprobs": 0}


def post(url: str, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=HEADERS, timeout=timeout)


def test_bad_staleness_values_are_a_400_naming_the_field(server, client):
    cases = [("/generate", {"prompt": "Hi", "sampling_params": {"max_weight_staleness": -1}},
              "sampling_params.max_weight_staleness"),
             ("/generate", {"prompt": "Hi", "sampling_params": {"min_weight_version": 1.5}},
              "sampling_params.min_weight_version"),
             ("/generate", {"prompt": "Hi", "sampling_params": {"stale_action": "drop"}},
              "sampling_params.stale_action"),
             # a delta stream cannot take back tokens it sent: restart is refused with stream
             ("/generate", {"prompt": "Hi", "stream": True, "sampling_params": {"max_weight_staleness": 0,
                                                                                "stale_action": "restart"}},
              "sampling_params.stale_action"),
             ("/v1/completions", {"prompt": "Hi", "max_weight_staleness": "1"}, "max_weight_staleness"),
             ("/v1/completions", {"prompt": "Hi", "stream": True, "stale_action": "restart"}, "stale_action"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "min_weight_version": -3},
              "min_weight_version")]
    for path, body, param in cases:
        r = post(server.url, path, body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param.split(".")[-1] in err["message"], (path, body, err)
    out = client.generate("Hi", {"max_tokens": 2, "max_weight_staleness": 0, "min_weight_version": 0})[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"  # the server goes on serving


@pytest.fixture(scope="module")
def own_server():
    """A server of this module's own: its pushes and versions touch no other test."""
    s = start_server()
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def own_client(own_server):
    with RolloutClient(own_server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def perturbed_dir(tmp_path_factory, own_client) -> str:
    folder = tmp_path_factory.mktemp("perturbed")
    state = perturbed_state(own_client.server_info()["model_path"])
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return str(folder)


def stream_until(url: str, body: dict, num_tokens: int, reached: threading.Event, box: dict) -> None:
    """A streamed /generate (NDJSON deltas): sets `reached` once it holds num_tokens tokens."""
    tokens, versions, reason = [], [], None
    with httpx.stream("POST", url + "/generate", json=dict(body, stream=True), headers=HEADERS, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            out = httpx.Response(200, content=line).json()["outputs"][0]
            tokens += out["token_ids"]
            versions += out["weight_versions"]
            reason = out["finish_reason"] or reason
            if len(tokens) >= num_tokens:
                reached.set()
    box.update(tokens=tokens, versions=versions, finish_reason=reason)


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} " if want else f"{name} "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.slow
def test_a_push_while_requests_run_ends_or_restarts_the_stale_ones(own_server, own_client, perturbed_dir):
    """Requests run concurrently through /generate and /v1/completions; a perturbed checkpoint is
    pushed from disk in the middle (pause keep, as a trainer does). max_weight_staleness 0 ends
    them "stale" with their old-version tokens (KV freed: the server runs on); "restart" ends with
    tokens all of the new version, equal to a fresh greedy request under the new weights; requests
    without the field go on across the push; /metrics counts the stale ones by action."""
    url, client = own_server.url, own_client
    v0 = client.weight_version()
    before = client.metrics()
    stale0 = dict(GREEDY, max_weight_staleness=0)
    reached, streamed = threading.Event(), {}
    with ThreadPoolExecutor(8) as pool:
        finish = pool.submit(post, url, "/generate", {"prompt": PROMPTS[:2], "sampling_params": stale0})
        restart = pool.submit(post, url, "/generate", {"prompt": PROMPTS[2], "sampling_params": dict(
            stale0, stale_action="restart", n=1)})
        free = pool.submit(post, url, "/generate", {"prompt": PROMPTS[0], "sampling_params": GREEDY})
        completion = pool.submit(post, url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 48,
                                                                "temperature": 0, "ignore_eos": True,
                                                                "max_weight_staleness": 0, "return_token_ids": True})
        # the streamed one goes last, once the others are there: when it has tokens, so have they (and a
        # fixed head start could let a fast machine finish their 48 tokens before the push)
        deadline = time.monotonic() + 120
        while client.server_info()["requests_in_flight"] < 5:  # "finish" is two
            assert time.monotonic() < deadline, "the requests did not arrive"
            time.sleep(0.05)
        watcher = pool.submit(stream_until, url, {"prompt": PROMPTS[2], "sampling_params": stale0}, 4, reached,
                              streamed)
        assert reached.wait(120), "the streamed request never got its tokens"
        client.pause(mode="keep")
        pushed = client.push_weights_from_disk(perturbed_dir, version=v0 + 1)
        client.resume()
        assert pushed["weight_version"] == v0 + 1
        results = {name: f.result(timeout=300) for name, f in
                   (("finish", finish), ("restart", restart), ("free", free), ("completion", completion))}
        watcher.result(timeout=300)
    for name, r in results.items():
        assert r.status_code == 200, (name, r.text)
    for res in results["finish"].json()["results"]:
        out = res["outputs"][0]
        assert out["finish_reason"] == "stale" and 1 <= len(out["token_ids"]) < 48, out
        assert out["weight_versions"] == [v0] * len(out["token_ids"]) and len(out["logprobs"]) == len(out["token_ids"])
    assert streamed["finish_reason"] == "stale" and set(streamed["versions"]) == {v0}
    choice = results["completion"].json()["choices"][0]
    assert choice["finish_reason"] == "stale" and set(choice["weight_versions"]) == {v0}, choice
    free = results["free"].json()["results"][0]["outputs"][0]
    assert free["finish_reason"] == "length" and free["weight_versions"][0] == v0
    assert free["weight_versions"][-1] == v0 + 1  # it went on across the push
    restarted = results["restart"].json()["results"][0]["outputs"][0]
    assert restarted["finish_reason"] == "length" and restarted["weight_versions"] == [v0 + 1] * 48
    fresh = client.generate(PROMPTS[2], GREEDY)[0]  # under the pushed weights
    assert restarted["token_ids"] == fresh.token_ids
    assert restarted["logprobs"] == pytest.approx(fresh.logprobs, abs=1e-4)
    after = client.metrics()
    for action, n in (("finish", 4), ("restart", 1)):
        name = "rollout_stale_requests_total"
        assert metric(after, name, action=action) - metric(before, name, action=action) == n, action
    assert metric(after, "rollout_requests_finished_total", finish_reason="stale") - metric(
        before, "rollout_requests_finished_total", finish_reason="stale") == 4
    assert metric(after, "rollout_num_requests_running") == 0 and metric(after, "rollout_kv_cache_usage_ratio") == 0


@pytest.mark.slow
def test_min_weight_version_waits_for_the_push(own_server, own_client):
    """A request for the next version waits (a request without it runs meanwhile), then runs
    under that version once it is pushed; the wait can be aborted."""
    url, client = own_server.url, own_client
    v = client.weight_version()
    with ThreadPoolExecutor(3) as pool:
        later = pool.submit(post, url, "/generate", {"prompt": PROMPTS[0], "request_id": "later",
                                                     "sampling_params": dict(GREEDY, max_tokens=6,
                                                                             min_weight_version=v + 1)})
        never = pool.submit(post, url, "/generate", {"prompt": PROMPTS[1], "request_id": "never",
                                                     "sampling_params": dict(GREEDY, max_tokens=6,
                                                                             min_weight_version=v + 99)})
        now = client.generate(PROMPTS[1], dict(GREEDY, max_tokens=6))[0]
        assert now.weight_versions == [v] * 6
        time.sleep(1.0)
        assert not later.done() and not never.done()
        client.reload_weights(version=v + 1)  # (no pause needed: the waiting ones hold no KV, run nothing)
        out = later.result(timeout=120).json()["results"][0]["outputs"][0]
        assert out["weight_versions"] == [v + 1] * 6 and out["finish_reason"] == "length"
        assert not never.done()
        client.abort_requests(["never"])
        out = never.result(timeout=60).json()["results"][0]["outputs"][0]
        assert out["finish_reason"] == "abort" and out["token_ids"] == []
    # a caller that gives up waiting (its timeout: it disconnects) takes its request away with it
    with pytest.raises(httpx.ReadTimeout):
        post(url, "/generate", {"prompt": PROMPTS[2], "sampling_params": dict(GREEDY, min_weight_version=v + 99)},
             timeout=2)
    deadline = time.monotonic() + 30
    while metric(client.metrics(), "rollout_num_requests_waiting") or metric(client.metrics(),
                                                                             "rollout_requests_in_flight"):
        assert time.monotonic() < deadline, "the request of a caller that went away still waits"
        time.sleep(0.2)
