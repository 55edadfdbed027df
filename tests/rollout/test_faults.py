"""Fault suite (slow, real processes): a weight push that goes wrong must leave the old weights
serving, bit for bit (the engine's checksum), and the server healthy and able to take the next
push from a new group.

- a trainer killed where the first, the middle or the last bucket of its push should go;
- a trainer that stops answering in the middle of a push (its group's timeout ends the push);
- checkpoints on disk that are truncated or hold an integer tensor;
- the engine core killed during a swap: the server exits with status 1 (an orchestrator
  restarts it) and the restarted server serves the untouched checkpoint.
"""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout.client import RolloutAPIError, RolloutClient
from tests.rollout.conftest import ADMIN_KEY, API_KEY, REPO_ROOT, children_of, start_server, stop_server

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def fault_server():
    server = start_server()
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.fixture()
def client(fault_server):
    with RolloutClient(fault_server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
        yield c


def check_whole_and_serving(client: RolloutClient, checksum: str, tokens: list[int]) -> None:
    """The old weights, bit for bit; generation runs; a new group forms and a push goes through."""
    assert client.weights_checksum() == checksum
    if client.is_paused():  # the trainer died holding the pause: its operator resumes
        client.resume()
    assert client.generate([1, 2, 3], GREEDY)[0].token_ids == tokens
    model = Path(client.model_info()[0]["root"])
    original = load_file(str(model / "model.safetensors"))
    version = client.weight_version()
    client.init_weight_transfer(backend="gloo", timeout_s=30)
    try:
        client.push_weights([("model.norm.weight", original["model.norm.weight"])], version=version + 1)
    finally:
        client.close_weight_transfer()
    assert client.weight_version() == version + 1 and client.weights_checksum() == checksum


def run_faulty_trainer(url: str, how: str, where: str, model_dir: str) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "tests.rollout.faulty_trainer", url, ADMIN_KEY, how, where,
                             model_dir], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_trainer_killed_mid_push(client, fault_server, where):
    checksum, tokens = client.weights_checksum(), client.generate([1, 2, 3], GREEDY)[0].token_ids
    trainer = run_faulty_trainer(fault_server.url, "exit", where, client.model_info()[0]["root"])
    out, _ = trainer.communicate(timeout=180)
    assert trainer.returncode == 1 and "buckets" in out, out
    check_whole_and_serving(client, checksum, tokens)


def test_a_trainer_that_stops_answering_mid_push(client, fault_server):
    """The server's receiver gives up after the group's timeout (8 s here); the calls queued
    behind the update (the checksum) are answered once it has."""
    checksum, tokens = client.weights_checksum(), client.generate([1, 2, 3], GREEDY)[0].token_ids
    trainer = run_faulty_trainer(fault_server.url, "hang", "middle", client.model_info()[0]["root"])
    try:
        line = trainer.stdout.readline()
        while line and not line.startswith("sent "):
            line = trainer.stdout.readline()
        assert line.startswith("sent "), "the trainer never started its push"
        t0 = time.monotonic()
        assert client.weights_checksum() == checksum
        assert time.monotonic() - t0 < 60, "the push of a silent trainer took too long to fail"
        check_whole_and_serving(client, checksum, tokens)
        assert trainer.poll() is None  # still hung: the server did not depend on it
    finally:
        trainer.kill()
        trainer.wait()


def test_bad_checkpoints_on_disk(client, tmp_path):
    checksum = client.weights_checksum()
    model = Path(client.model_info()[0]["root"])
    truncated = tmp_path / "truncated"
    shutil.copytree(model, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    integer = tmp_path / "integer"
    shutil.copytree(model, integer)
    state = load_file(str(integer / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int64)
    save_file(state, str(integer / "model.safetensors"))
    for path, words in ((truncated, "safetensors"), (integer, "floating point")):
        with pytest.raises(RolloutAPIError) as e:
            client.push_weights_from_disk(str(path), version=client.weight_version() + 1)
        assert e.value.status == 400 and words in e.value.message, e.value
        assert client.weights_checksum() == checksum
    assert client.health()


def test_engine_core_killed_during_a_swap(tmp_path):
    server = start_server()
    try:
        c = RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120)
        checksum = c.weights_checksum()
        model = c.model_info()[0]["root"]
        [core] = children_of(server.proc.pid)
        errors = []
        push = threading.Thread(target=lambda: _push_expecting_failure(c, model, errors))
        push.start()
        time.sleep(0.3)  # inside the update: reading, staging or swapping
        os.kill(core, signal.SIGKILL)
        code = server.proc.wait(60)
        push.join(60)
        assert code == 1, f"the server exited with {code} after its engine core died:\n{server.log()}"
        assert "engine died" in server.log(), server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    restarted = start_server()
    try:
        with RolloutClient(restarted.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c2:
            assert c2.weights_checksum() == checksum  # the checkpoint on disk was never touched
            assert c2.health()
    finally:
        assert stop_server(restarted) == 0


def _push_expecting_failure(client: RolloutClient, path: str, errors: list) -> None:
    try:
        client.push_weights_from_disk(path, version=client.weight_version() + 1)
    except Exception as e:  # noqa: BLE001 - the engine died under it
        errors.append(e)
