"""POST /weights/update (rollout/api/weight_update.py) against real server processes, this test
process the trainer: one HTTP call pauses, receives, swaps, clears caches and resumes; bad input
is a 4xx naming the field before anything changes; a failure names its phase and leaves the old
weights, the version and generation as they were (a pause the trainer made stays); idempotency
keys; two updates at once; an update beside /scale. The watchdog over a hung or killed trainer:
tests/rollout/test_faults.py."""
import shutil
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from rollout.client import RolloutAPIError, RolloutClient
from tests.rollout.conftest import ADMIN_KEY, API_KEY, start_server, stop_server
from tests.rollout.test_control import start_stream
from weight_sync import weights_checksum

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
PHASES = {"queue", "pause", "receive", "stage", "swap", "clear_cache", "resume"}


@pytest.fixture(scope="module")
def tx_server():
    server = start_server()
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.fixture(scope="module")
def client(tx_server):
    with RolloutClient(tx_server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model_path(client) -> str:
    return client.server_info()["model_path"]


@pytest.fixture(scope="module")
def original(model_path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_path) / "model.safetensors"))


def http_count(client: RolloutClient, route: str) -> float:
    for family in text_string_to_metric_families(client.metrics()):
        for s in family.samples:
            if s.name == "rollout_http_requests_total" and s.labels.get("route") == route:
                return s.value
    return 0.0


def test_one_call_pauses_pushes_swaps_and_resumes(client, original):
    """push_weights is one POST /weights/update beside the broadcast (no /pause, /resume or vLLM
    phase call); a request in flight is kept and continues on the new weights."""
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=60)
    try:
        routes = ("/pause", "/resume", "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/weights/update")
        before = {r: http_count(client, r) for r in routes}
        changed = {"model.norm.weight": original["model.norm.weight"] * 0.5}
        version = client.weight_version() + 1
        deltas, stream = start_stream(client, dict(GREEDY, max_tokens=200))
        result = client.push_weights(changed.items(), version=version)
        stream.join(300)
        assert result["weight_version"] == version and result["kept"] == 1 and result["aborted"] == 0, result
        assert set(result["phases"]) == PHASES and result["update"]["paused_here"] is True
        assert result["send"]["num_tensors"] == 1 and result["update"]["num_tensors"] == 1
        after = {r: http_count(client, r) for r in routes}
        assert {r: after[r] - before[r] for r in routes} == {**{r: 0 for r in routes}, "/weights/update": 1}
        versions = [v for d in deltas for v in d.weight_versions]
        assert len(versions) == 200 and versions[0] == version - 1 and versions[-1] == version
        assert client.weights_checksum() == weights_checksum({**original, **changed}.items(), torch.float32)
        assert not client.is_paused()
        client.push_weights([("model.norm.weight", original["model.norm.weight"])])
        assert client.weights_checksum() == weights_checksum(original.items(), torch.float32)
    finally:
        client.close_weight_transfer()


def test_bad_input_is_a_4xx_naming_the_field_before_anything_changes(tx_server, client, model_path):
    version, checksum = client.weight_version(), client.weights_checksum()
    cases = [({"source": "disk"}, 400, "path"),
             ({"source": "disk", "path": "relative/folder"}, 400, "path"),
             ({"source": "disk", "path": "/no/such/folder"}, 400, "path"),
             ({"source": "gloo", "path": model_path}, 400, "path"),
             ({"source": "ipc"}, 400, "handles"),
             ({"source": "disk", "path": model_path, "deadline_s": 0.5}, 400, "deadline_s"),
             ({"source": "disk", "path": model_path, "pause_mode": "sometimes"}, 400, "pause_mode"),
             ({"source": "disk", "path": model_path, "pause_mode": "abort", "recompute_kv": True}, 400, "recompute_kv"),
             ({"source": "gloo", "update_info": {"weight_version": 3}}, 400, "update_info.weight_version"),
             ({"source": "gloo", "update_info": {"names": ["a", "b"], "shapes": [[1]]}}, 400, "update_info"),
             ({"source": "nccl"}, 400, "source"),
             ({"source": "smoke signals"}, 400, "source"),
             ({"source": "disk", "path": model_path, "lora_name": "no-such-adapter"}, 404, "lora_name"),
             ({"source": "disk", "path": model_path, "idempotency_key": ""}, 400, "idempotency_key"),
             ({"source": "disk", "path": model_path, "version": version}, 409, "weight_version")]
    for body, status, param in cases:
        r = httpx.post(tx_server.url + "/weights/update", json=body, headers=ADMIN, timeout=60)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.json())
    r = httpx.post(tx_server.url + "/weights/update", json={"source": "disk", "path": model_path}, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 403  # an admin route
    assert client.weight_version() == version and client.weights_checksum() == checksum and not client.is_paused()


def test_a_failure_rolls_back_and_names_its_phase(client, original, model_path, tmp_path):
    """Refused pushes (a shape over the group, a truncated checkpoint on disk) fail phase "stage":
    the weights and the version are as before, generation never stopped (the refusal comes before
    the pause, which is only for the swap), the group still carries the next push. A pause the
    trainer made stays through a failed update and a successful one."""
    version, checksum = client.weight_version(), client.weights_checksum()
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=60)
    try:
        with pytest.raises(RolloutAPIError) as e:
            client.push_weights([("model.norm.weight", torch.zeros(3))])
        assert (e.value.status, e.value.phase, e.value.weight_version) == (400, "stage", version), e.value
        assert "shape" in e.value.message and "generation resumed" not in e.value.message
        assert not client.is_paused() and client.weights_checksum() == checksum
        assert client.push_weights([("model.norm.weight", original["model.norm.weight"])])["weight_version"] == \
            version + 1
    finally:
        client.close_weight_transfer()
    truncated = tmp_path / "truncated"
    shutil.copytree(model_path, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(RolloutAPIError) as e:
        client.push_weights_from_disk(str(truncated))
    assert (e.value.status, e.value.phase, e.value.weight_version) == (400, "stage", version + 1), e.value
    assert not client.is_paused() and client.weights_checksum() == checksum
    client.pause(mode="keep")  # the trainer's own pause: this call neither makes nor lifts it
    try:
        with pytest.raises(RolloutAPIError) as e:
            client.push_weights_from_disk(str(truncated))
        assert e.value.phase == "stage" and "generation resumed" not in e.value.message
        assert client.is_paused()
        result = client.push_weights_from_disk(model_path)
        assert result["paused_here"] is False and result["weight_version"] == version + 2 and client.is_paused()
    finally:
        client.resume()
    assert client.weights_checksum() == checksum


def test_a_deadline_in_the_pause_resumes_generation(client, original, tmp_path):
    """pause_mode "wait" drains a long request once the update is staged: past deadline_s the
    update fails in phase "pause" (504), the request goes on and completes under the old version."""
    from safetensors.torch import save_file

    version = client.weight_version()
    save_file({"model.norm.weight": original["model.norm.weight"]}, tmp_path / "model.safetensors")  # read at once
    # the shortest deadline the server takes and a request to the context's end (512): the drain outlasts
    # it on a fast machine too (300 tokens drain within 2 s at 150 tokens/s)
    deltas, stream = start_stream(client, dict(GREEDY, max_tokens=500))
    t0 = time.monotonic()
    with pytest.raises(RolloutAPIError) as e:
        client.weights_update("disk", deadline_s=1.0, path=str(tmp_path), pause_mode="wait")
    assert (e.value.status, e.value.phase, e.value.weight_version) == (504, "pause", version), e.value
    assert time.monotonic() - t0 < 10
    assert not client.is_paused()
    stream.join(300)
    assert deltas[-1].finish_reason == "length"
    assert {v for d in deltas for v in d.weight_versions} == {version}
    assert client.weight_version() == version


def test_idempotency_keys(client, original, model_path):
    version = client.weight_version()
    key = f"disk-{uuid.uuid4()}"
    first = client.push_weights_from_disk(model_path, idempotency_key=key)
    again = client.push_weights_from_disk(model_path, idempotency_key=key)
    assert first["weight_version"] == again["weight_version"] == version + 1 == client.weight_version()
    assert (first["replayed"], again["replayed"]) == (False, True)
    assert client.weights_update_status(key) == {"idempotency_key": key, "status": "done", "result": first}
    with pytest.raises(RolloutAPIError) as e:  # the key of another update
        client.push_weights_from_disk(model_path, version=version + 5, idempotency_key=key)
    assert e.value.status == 422 and e.value.param == "idempotency_key"
    # a failed attempt is forgotten: the key may be used again
    failed = f"failed-{uuid.uuid4()}"
    with pytest.raises(RolloutAPIError) as e:
        client.push_weights_from_disk(model_path, version=version, idempotency_key=failed)
    assert e.value.status == 409
    assert client.push_weights_from_disk(model_path, version=version + 2, idempotency_key=failed)["replayed"] is False
    # two retries at once: one update, one answer
    both, key2 = [], f"twice-{uuid.uuid4()}"

    def push():
        with RolloutClient(client.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=300) as c:  # own connection
            both.append(c.push_weights_from_disk(model_path, idempotency_key=key2))

    threads = [threading.Thread(target=push) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [r["weight_version"] for r in both] == [version + 3] * 2 and client.weight_version() == version + 3
    assert sorted(r["replayed"] for r in both) == [False, True]
    # over the group: a retry moves no byte (the sender would block on nobody) and the group stays usable
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=60)
    try:
        key3, named = f"group-{uuid.uuid4()}", [("model.norm.weight", original["model.norm.weight"])]
        first = client.push_weights(named, idempotency_key=key3)
        again = client.push_weights(named, idempotency_key=key3)
        assert again["replayed"] and again["send"] is None and again["weight_version"] == first["weight_version"]
        assert client.push_weights(named)["weight_version"] == first["weight_version"] + 1
    finally:
        client.close_weight_transfer()
    assert client.weights_checksum() == weights_checksum(original.items(), torch.float32)


def test_two_updates_at_once_run_one_after_the_other(client, original, model_path):
    """The second waits for the control lock (the first's pause is never lifted halfway): both
    succeed, each with its own version, one after the other."""
    version = client.weight_version()
    results, errors = [], []
    go = threading.Barrier(2)

    def push(i):
        try:
            with RolloutClient(client.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=300) as c:
                c.server_info()  # (connected, and the shared push knows the dtype: both post at once)
                go.wait(60)
                t0 = time.monotonic()
                if i == 0:
                    r = c.push_weights_from_disk(model_path)
                else:
                    r = c.push_weights_shared([("model.norm.weight", original["model.norm.weight"])],
                                              dtype=torch.float32)
                results.append(dict(r, t0=t0, t1=time.monotonic()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert sorted(r["weight_version"] for r in results) == [version + 1, version + 2]
    first, second = sorted(results, key=lambda r: r["weight_version"])
    assert second["t0"] < first["t1"], "the two updates did not run at once"
    # the second waited for the first (its "queue" phase is the wait for the control lock)
    assert second["phases"]["queue"] >= first["t1"] - second["t0"] - 0.5, (first, second)
    assert client.weight_version() == version + 2 and not client.is_paused()
    assert client.weights_checksum() == weights_checksum(original.items(), torch.float32)


def test_an_update_beside_scale(client, model_path):
    """/scale and /weights/update at once, growing then shrinking: neither deadlocks, both
    succeed, and every replica holds the update under one version (the replicas' versions and
    checksums agree, or those calls fail)."""
    version = client.weight_version()
    for size, new_version in ((2, version + 1), (1, version + 2)):
        out, errors = {}, []

        def run(name, fn, out=out, errors=errors):
            try:
                with RolloutClient(client.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=600) as c:
                    out[name] = fn(c)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=("scale", lambda c, size=size: c.scale(size, drain_timeout_s=60))),
                   threading.Thread(target=run, args=("update", lambda c: c.push_weights_from_disk(model_path)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        assert out["scale"]["data_parallel_size"] == size and out["update"]["weight_version"] == new_version
        assert client.get_world_size() == size
        assert client.weight_version() == new_version  # replicas that disagree make this a 409
        client.weights_checksum()  # likewise
        assert client.generate([1, 2, 3], GREEDY)[0].weight_versions == [new_version] * GREEDY["max_tokens"]
        assert not client.is_paused()
