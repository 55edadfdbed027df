"""Fault suite (slow, real processes): a weight push that goes wrong must leave the old weights
serving, bit for bit (the engine's checksum), and the server healthy and able to take the next
push from a new group.

- a trainer killed where the first, the middle or the last bucket of its push should go;
- a trainer that stops answering in the middle of a push (its group's timeout ends the push);
- the same two under POST /weights/update (the watchdog): a trainer that sends half its buckets
  and hangs fails the update at its deadline_s (504, phase "receive"; the group's own timeout is
  far longer), one killed mid-broadcast at once (500, phase "receive"); then a new group forms
  and a clean push serves exactly the pushed weights (greedy outputs equal transformers' on them);
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
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=30)
    try:
        client.push_weights([("model.norm.weight", original["model.norm.weight"])], version=version + 1)
    finally:
        client.close_weight_transfer()
    assert client.weight_version() == version + 1 and client.weights_checksum() == checksum


def run_faulty_trainer(url: str, how: str, where: str, model_dir: str, route: str = "phases") -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "tests.rollout.faulty_trainer", url, ADMIN_KEY, how, where,
                             model_dir, route], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, prefix: str) -> str:
    line = proc.stdout.readline()
    while line and not line.startswith(prefix):
        line = proc.stdout.readline()
    assert line.startswith(prefix), f"the trainer never printed {prefix!r} (exit code {proc.poll()})"
    return line


def clean_push_serves_the_pushed_weights(client: RolloutClient) -> None:
    """A new group forms and a push of perturbed weights goes through /weights/update: the greedy
    outputs are transformers' on those weights; then the originals go back."""
    from tests.engine.hf_reference import hf_greedy
    from tests.engine.perturb import hf_model_with, perturbed_state

    model = client.model_info()[0]["root"]
    state = perturbed_state(model, seed=3)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    expected = [r[0] for r in hf_greedy(hf_model_with(model, state), prompts, GREEDY["max_tokens"])]
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=30)
    try:
        version = client.push_weights(state.items(), deadline_s=120)["weight_version"]
        outs = client.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected and {v for o in outs for v in o.weight_versions} == {version}
        client.push_weights(load_file(str(Path(model) / "model.safetensors")).items())
    finally:
        client.close_weight_transfer()


WATCHDOG_DEADLINE_S = 10.0


@pytest.mark.parametrize("how", ["hang", "exit"])
def test_weights_update_watchdog(client, fault_server, how):
    """POST /weights/update beside a trainer that sends half its buckets, then stops answering
    (its group's timeout is 60 s: only the update's deadline can end the push in time) or dies.
    The update fails in phase "receive" (504 past the deadline / 500 for the broken transport),
    within the deadline; the old weights serve bit for bit, generation is resumed; a new group
    then carries a clean push."""
    checksum, tokens = client.weights_checksum(), client.generate([1, 2, 3], GREEDY)[0].token_ids
    version = client.weight_version()
    trainer = run_faulty_trainer(fault_server.url, how, "middle", client.model_info()[0]["root"], route="tx")
    try:
        read_until(trainer, "group formed")
        t0 = time.monotonic()
        with pytest.raises(RolloutAPIError) as e:
            client.weights_update("gloo", deadline_s=WATCHDOG_DEADLINE_S)
        elapsed = time.monotonic() - t0
        assert e.value.phase == "receive" and e.value.weight_version == version, e.value
        if how == "hang":
            assert e.value.status == 504 and "deadline" in e.value.message, e.value
            assert WATCHDOG_DEADLINE_S - 1 < elapsed < WATCHDOG_DEADLINE_S + 5, elapsed
            assert trainer.poll() is None  # still hung: the server did not depend on it
        else:
            assert e.value.status == 500 and e.value.type == "weight_transfer_error", e.value
            assert elapsed < WATCHDOG_DEADLINE_S, elapsed
            assert "sent" in trainer.communicate(timeout=60)[0]
        assert not client.is_paused() and client.weight_version() == version
        check_whole_and_serving(client, checksum, tokens)
        clean_push_serves_the_pushed_weights(client)
        assert client.weights_checksum() == checksum
    finally:
        trainer.kill()
        trainer.wait()


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
