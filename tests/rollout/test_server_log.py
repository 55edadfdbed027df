"""What `rollout serve` tells its operator: the ready banner (URL, dtype and device served,
replicas, how to stop it) on stdout; on stderr one line per request (method, path, status, ms;
an error's message with it) and one per pause, resume and weight push; no /docs or /redoc
(their assets come from a CDN), /openapi.json stays."""
import time

import httpx

from tests.rollout.conftest import API_KEY

USER = {"Authorization": f"Bearer {API_KEY}"}


def wait_for(server, text: str, timeout_s: float = 10.0, after: int = 0) -> str:
    """The log once it holds more than `after` lines with `text` (the session's server is shared:
    earlier tests may have logged the same kind of line)."""
    deadline = time.monotonic() + timeout_s
    while server.log(100_000).count(text) <= after:
        assert time.monotonic() < deadline, f"{text!r} not in the server's log:\n{server.log()}"
        time.sleep(0.05)
    return server.log(100_000)


def test_banner_says_where_what_and_how_to_stop(server):
    deadline = time.monotonic() + 10
    while len(server.stdout) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    first, second = server.stdout[:2]
    assert first.startswith("[rollout] serving ") and f"on {server.url}" in first and "API key required" in first
    assert second == "[rollout] float32 on cpu, 1 replica, max_model_len 512; Ctrl-C (or SIGTERM) stops it"


def test_requests_errors_and_control_are_logged(server, client):
    client.generate("hi", {"max_tokens": 2})
    wait_for(server, "POST /generate 200 ")
    before = server.log(100_000).count("POST /generate 400 ")
    r = httpx.post(server.url + "/generate", json={"prompt": "a", "sampling_params": {"top_p": 5}}, headers=USER)
    assert r.status_code == 400
    log = wait_for(server, "POST /generate 400 ", after=before)
    assert "(param: sampling_params.top_p)" in log.split("POST /generate 400 ")[-1].splitlines()[0]
    client.pause(mode="keep")
    client.resume()
    wait_for(server, "generation paused (mode keep)")
    wait_for(server, "generation resumed after ")


def test_no_swagger_ui_but_the_openapi_document(server):
    for path in ("/docs", "/redoc"):
        assert httpx.get(server.url + path, headers=USER).status_code == 404
    doc = httpx.get(server.url + "/openapi.json", headers=USER).json()
    assert "/generate" in doc["paths"] and "/docs" not in doc["paths"]
