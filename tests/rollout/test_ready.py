"""Readiness gated on the weight version, over HTTP on a real server started as a server
restarted in the middle of a run is (`--min-weight-version 2`: the version the trainer last
pushed): GET /ready and GET /health?min_weight_version=N answer 503 naming the replica and the
version it holds until every replica holds the version wanted, /ready waits for it with `wait_s`
(a push landing meanwhile ends the wait), and a level-2 sleep (no weights) is not ready either.
Liveness (plain /health) is not affected. Replicas added by /scale: tests/rollout/test_scale_out.py.
"""
import threading
import time

import httpx
import pytest

from rollout.client import RolloutAPIError, RolloutClient
from tests.rollout.conftest import ADMIN_KEY, API_KEY, start_server, stop_server


@pytest.fixture(scope="module")
def server():
    server = start_server("--min-weight-version", "2")
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.fixture()
def client(server):
    with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
        yield c


def test_ready_follows_the_weight_version(server, client):
    # no key needed: an orchestrator's probe
    r = httpx.get(server.url + "/ready", timeout=30)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert "replica 0 holds weight version 0 < 2" in err["message"], err
    assert err["replicas"] == [{"replica": 0, "weight_version": 0, "has_weights": True}]
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"  # alive all the same
    assert client.generate("Hi", {"max_tokens": 2})[0].token_ids  # and serving

    client.reload_weights(version=1)
    assert httpx.get(server.url + "/ready", timeout=30).status_code == 503  # 1 < 2 still
    client.reload_weights(version=2)
    assert client.ready() == {"status": "ready", "weight_version": 2,
                              "replicas": [{"replica": 0, "weight_version": 2, "has_weights": True}]}

    # the trainer names the version it needs: not there yet
    r = httpx.get(server.url + "/health", params={"min_weight_version": 3}, timeout=30)
    assert r.status_code == 503 and "version 2 < 3" in r.json()["error"]["message"], r.text
    with pytest.raises(RolloutAPIError) as e:
        client.ready(min_weight_version=3)
    assert e.value.status == 503
    assert httpx.get(server.url + "/health", params={"min_weight_version": 2}, timeout=30).json()["status"] == "ok"


def test_ready_waits_for_a_push_that_lands_meanwhile(client):
    live = client.weight_version()
    box = {}

    def wait():
        t0 = time.monotonic()
        box["answer"] = client.ready(min_weight_version=live + 1, wait_s=60)
        box["seconds"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive(), box  # not ready: it waits
    client.reload_weights(version=live + 1)
    waiter.join(60)
    assert box["answer"]["weight_version"] == live + 1, box
    assert 1.0 <= box["seconds"] < 30, box


def test_ready_gives_up_after_wait_s(client):
    t0 = time.monotonic()
    with pytest.raises(RolloutAPIError) as e:
        client.ready(min_weight_version=client.weight_version() + 5, wait_s=1.0)
    assert e.value.status == 503 and 0.9 <= time.monotonic() - t0 < 20


def test_a_level_2_sleep_is_not_ready(server, client):
    client.sleep(level=2)
    try:
        r = httpx.get(server.url + "/ready", timeout=30)
        assert r.status_code == 503 and "hold no weights" in r.json()["error"]["message"], r.text
    finally:
        client.wake_up()
        client.reload_weights(version=client.weight_version() + 1)
    assert client.ready()["status"] == "ready"


@pytest.mark.parametrize("query", [{"min_weight_version": -1}, {"min_weight_version": "x"}, {"wait_s": 10_000}])
def test_bad_queries_are_400(server, query):
    r = httpx.get(server.url + "/ready", params=query, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == next(iter(query)), r.text
