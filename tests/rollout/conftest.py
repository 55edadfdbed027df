"""One real server for the whole session: `rollout serve` in a subprocess on a free port (port 0;
the URL is read from its ready line), the real default model in float32 (exact greedy parity),
API keys on, a small context and body limit so the limits are cheap to hit.

Teardown sends SIGTERM and checks a clean exit: return code 0 and no engine-core child left.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout.client import RolloutClient
from rollout.dashboard import read_wandb_run

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY, ADMIN_KEY = "test-user-key", "test-admin-key"
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 1 << 20
STARTUP_TIMEOUT_S = 240


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        return Path(self.log_path).read_text()[-4000:]


def rollout_command() -> list[str]:
    script = Path(sys.executable).parent / "rollout"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout.cli"]


def start_server(*extra: str) -> Server:
    log = tempfile.NamedTemporaryFile("w", prefix="rollout-serve-", suffix=".log", delete=False)
    cmd = rollout_command() + ["serve", "--port", "0", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                               "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
                               "--max-body-bytes", str(MAX_BODY_BYTES), "--shutdown-grace-s", "2", *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT, env=env)
    found: dict = {}

    def read():
        for line in proc.stdout:
            m = re.search(r"on (http://\S+)", line)
            if m and "url" not in found:
                found["url"] = m.group(1)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while "url" not in found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rollout serve did not come up:\n{Path(log.name).read_text()[-4000:]}")
        time.sleep(0.1)
    return Server(found["url"], proc, log.name)


def wandb_history(wandb_dir) -> list[dict]:
    """The history rows of the one offline W&B run under `wandb_dir` (read with wandb's own reader
    of its transaction log, as `rollout dashboard` reads them)."""
    runs = list(Path(wandb_dir).glob("wandb/offline-run-*"))
    assert len(runs) == 1, f"expected one offline W&B run under {wandb_dir}: {runs}"
    return read_wandb_run(runs[0])


def children_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def stop_server(server: Server, timeout: float = 60.0) -> int:
    kids = children_of(server.proc.pid)
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{k}").exists() and "zombie" not in _status(k) for k in kids):
        assert time.monotonic() < deadline, f"engine core(s) {kids} survived the server"
        time.sleep(0.1)
    return code


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


@pytest.fixture(scope="session")
def server():
    s = start_server()
    yield s
    code = stop_server(s)
    assert code == 0, f"rollout serve exited with {code}:\n{s.log()}"


@pytest.fixture(scope="session")
def client(server) -> RolloutClient:
    with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model_path(server, client) -> str:
    return client.server_info()["model_path"]
