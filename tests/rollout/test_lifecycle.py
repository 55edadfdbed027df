"""Servers of their own (slow: more model loads): SIGINT while a stream and a paused-queue
request are in flight -> both get a final response, the process exits 0 and no engine core
survives; --wandb-project in offline mode writes a run with the metric series; an engine core
killed with SIGKILL turns /health and generation into 503 within seconds, and the server still
shuts down cleanly."""
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.rollout.conftest import ADMIN_KEY, API_KEY, children_of, start_server, wandb_history

pytestmark = pytest.mark.slow
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_sigint_gives_in_flight_requests_a_final_response_and_leaves_no_child(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    server = start_server("--wandb-project", "rollout-test", "--wandb-interval-s", "0.5")
    kids = children_of(server.proc.pid)
    assert kids, "no engine core child"
    events, done = [], threading.Event()

    def stream():
        body = {"prompt": "Tell me a long story", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=USER, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    deadline = time.monotonic() + 120
    while len(events) < 3:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.05)
    time.sleep(1.0)  # let W&B log a few points
    assert httpx.post(server.url + "/pause", params={"mode": "keep"}, headers=ADMIN, timeout=60).status_code == 200
    queued = {}

    def late():  # arrives while paused: waits for a resume that only the shutdown brings
        queued["r"] = httpx.post(server.url + "/generate", json={"prompt": "Hi", "sampling_params": {
            "max_tokens": 400, "ignore_eos": True}}, headers=USER, timeout=120)

    late_thread = threading.Thread(target=late, daemon=True)
    late_thread.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGINT)
    assert done.wait(60), "the stream got no final response"
    late_thread.join(60)
    assert queued["r"].status_code == 200, queued["r"].text
    assert queued["r"].json()["results"][0]["outputs"][0]["finish_reason"] == "abort"
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(60) == 0, server.log()
    time.sleep(1.0)
    assert not [k for k in kids if Path(f"/proc/{k}").exists()], "an engine core survived"
    rows = wandb_history(tmp_path)
    assert len(rows) >= 3, rows
    assert max(r["engine/num_generated_tokens"] for r in rows) > 0
    assert max(r["engine/throughput_tokens_per_s"] for r in rows) > 0
    assert max(r["engine/kv_usage"] for r in rows) > 0
    assert rows[0]["engine/is_paused"] == 0 and rows[-1]["engine/is_paused"] == 1  # the last point: at shutdown


def test_dead_engine_core_is_503_not_a_hang():
    server = start_server()
    try:
        [core] = children_of(server.proc.pid)
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after the engine core died"
            time.sleep(0.1)
        r = httpx.post(server.url + "/generate", json={"prompt": "Hi"}, headers=USER, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead_error", r.text
        assert httpx.get(server.url + "/health", timeout=10).json()["error"]["code"] == 503
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()
