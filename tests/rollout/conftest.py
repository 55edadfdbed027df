"""One real server for the whole session: `rollout serve` in a subprocess on a free port (port 0;
the URL is read from its ready line), the real default model in float32 (exact greedy parity),
API keys on, a small context and body limit so the limits are cheap to hit.

Teardown sends SIGTERM and checks a clean exit: return code 0 and no engine-core child left.
"""
import tempfile
import time
from pathlib import Path

import pytest

from rollout.client import RolloutClient
from rollout.dashboard import read_wandb_run
from rollout.subprocess_server import ServerProcess, start

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY, ADMIN_KEY = "test-user-key", "test-admin-key"
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 1 << 20
STARTUP_TIMEOUT_S = 240
PROFILER_DIR = tempfile.mkdtemp(prefix="rollout-traces-")  # the session server's --profiler-dir


def start_server(*extra: str) -> ServerProcess:
    log = tempfile.NamedTemporaryFile("w", prefix="rollout-serve-", suffix=".log", delete=False)
    log.close()
    return start("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY,
                 "--admin-api-key", ADMIN_KEY, "--max-body-bytes", str(MAX_BODY_BYTES), "--shutdown-grace-s", "2",
                 "--profiler-dir", PROFILER_DIR, *extra, log_path=log.name, cwd=REPO_ROOT, timeout_s=STARTUP_TIMEOUT_S)


def tiny_model_folder(folder: Path, default_model_path: str) -> str:
    """A tiny random Llama (2 layers, hidden 64) with the default model's tokenizer, saved in
    `folder`: for servers whose tests need a model, not its quality."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                                 num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                                 max_position_embeddings=256)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path) / name, Path(folder) / name)
    return str(folder)


def wandb_history(wandb_dir) -> list[dict]:
    """The history rows of the one offline W&B run under `wandb_dir` (read with wandb's own reader
    of its transaction log, as `rollout dashboard` reads them)."""
    runs = list(Path(wandb_dir).glob("wandb/offline-run-*"))
    assert len(runs) == 1, f"expected one offline W&B run under {wandb_dir}: {runs}"
    return read_wandb_run(runs[0])


def children_of(pid: int) -> list[int]:
    """`pid`'s child processes, started from any of its threads (each thread lists its own)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def stop_server(server: ServerProcess, timeout: float = 60.0) -> int:
    """SIGTERM; returns the exit status once the server and its engine core(s) are gone."""
    kids = children_of(server.proc.pid)
    code = server.stop(timeout)
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
