"""Servers of their own (slow: more model loads): SIGINT while a stream and a paused-queue
request are in flight -> both get a final response, the process exits 0 and no engine core
survives; --wandb-project in offline mode writes a run with the metric series; an engine core
killed with SIGKILL makes the server exit with status 1 (or, with --stay-up-when-engine-dies, turns
/health and generation into 503 within seconds and still shuts down cleanly); kill -9 of the
server leaves neither an engine core nor an ipc socket folder behind."""
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
        # to the context's end (512): it must still run after the fixed second below, on a fast machine too
        body = {"prompt": "Tell me a long story", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
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
    deadline = time.monotonic() + 60
    while httpx.get(server.url + "/server_info", headers=ADMIN, timeout=30).json()["requests_in_flight"] < 2:
        assert time.monotonic() < deadline, "the late request did not arrive"  # (after SIGINT: a 503)
        time.sleep(0.05)
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
    """--stay-up-when-engine-dies: 503s (not a hang), zeroed gauges, and a clean SIGTERM exit."""
    server = start_server("--stay-up-when-engine-dies")
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
        metrics = httpx.get(server.url + "/metrics", headers=USER, timeout=10).text
        assert "rollout_engine_healthy 0.0" in metrics
        assert "rollout_num_requests_running 0.0" in metrics, "a gauge kept its last value"
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()


def _ipc_folders(server_pid: int, core_pid: int) -> set[Path]:
    """The ipc socket folders a server and its engine core use: the handshake address in the
    core's command line, and the unix sockets the server has bound."""
    cmdline = Path(f"/proc/{core_pid}/cmdline").read_text()
    folders = {Path(m.split("ipc://", 1)[1]).parent for m in cmdline.split("'") if m.startswith("ipc://")}
    inodes = {os.readlink(f"/proc/{server_pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server_pid}/fd")}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) > 7 and f"socket:[{cols[6]}]" in inodes and "/rollout-" in cols[7]:
            folders.add(Path(cols[7]).parent)
    return {f for f in folders if f.exists()}


def test_engine_death_exits_the_server_and_frontend_death_leaves_no_ipc_folders():
    # by default a server whose engine died exits with status 1 and says why
    server = start_server()
    [core] = children_of(server.proc.pid)
    os.kill(core, signal.SIGKILL)
    assert server.proc.wait(30) == 1, server.log()
    assert "the engine died" in server.log()
    # kill -9 of the front end: its engine core follows and removes the ipc socket folders
    server = start_server()
    [core] = children_of(server.proc.pid)
    folders = _ipc_folders(server.proc.pid, core)
    assert len(folders) >= 2, "found no ipc socket folder to watch"
    server.proc.kill()
    server.proc.wait(30)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{core}").exists() or any(f.exists() for f in folders):
        assert time.monotonic() < deadline, f"left behind: core alive={Path(f'/proc/{core}').exists()}, " \
                                             f"{[str(f) for f in folders if f.exists()]}"
        time.sleep(0.1)
