"""Several API servers (`rollout serve --api-server-count 2 --data-parallel-size 2`), real
processes: 64 concurrent streams are answered by both servers (x-rollout-api-server header)
and served by both replicas; a /pause through one server holds generation through the other;
/metrics aggregates the servers' counters; SIGKILL of one API server makes the launcher stop
everything: no process is left. /scale grows and shrinks while requests stream; a size the
machine cannot hold is a 400 before anything starts; a server stopped (SIGTERM, SIGKILL) during
a scale-up or while its engine cores start leaves no process behind."""
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.rollout.conftest import ADMIN_KEY, API_KEY, children_of, start_server

USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
pytestmark = pytest.mark.slow


def descendants(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        kids = children_of(stack.pop())
        out += kids
        stack += kids
    return out


def stream(url: str, i: int, box: dict) -> None:
    body = {"prompt": f"Count from {i} upwards:", "max_tokens": 8, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=300) as http:  # a connection of its own
        with http.stream("POST", url + "/v1/completions", json=body, headers=USER) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            box[i] = (r.status_code, r.headers.get("x-rollout-api-server"), lines)


def test_two_api_servers_two_replicas():
    server = start_server("--api-server-count", "2", "--data-parallel-size", "2")
    procs = descendants(server.proc.pid)
    try:
        assert len(procs) >= 5, procs  # 2 API servers, 2 engine cores, the coordinator
        box: dict = {}
        threads = [threading.Thread(target=stream, args=(server.url, i, box)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(box) == 64 and all(code == 200 for code, _, _ in box.values())
        assert all(lines[-1] == "data: [DONE]" for _, _, lines in box.values())
        by_server = [sum(1 for _, s, _ in box.values() if s == str(k)) for k in (0, 1)]
        assert min(by_server) > 0, by_server
        stats = httpx.get(server.url + "/metrics", headers=USER, timeout=30).text
        finished = sum(float(ln.split()[-1]) for ln in stats.splitlines()
                       if ln.startswith("rollout_requests_finished_total"))
        assert finished == 64, finished  # both servers' counters, summed
        info = httpx.get(server.url + "/server_info", headers=ADMIN, timeout=30).json()
        assert info["api_server_count"] == 2 and info["data_parallel_size"] == 2

        # a pause through one server is seen through every server and holds generation
        assert httpx.post(server.url + "/pause", params={"mode": "abort"}, headers=ADMIN,
                          timeout=60).status_code == 200
        for _ in range(8):  # fresh connections: both servers answer
            assert httpx.get(server.url + "/is_paused", headers=USER, timeout=30).json()["is_paused"] is True
        held: dict = {}
        t = threading.Thread(target=stream, args=(server.url, 99, held))
        t.start()
        time.sleep(1.0)
        assert 99 not in held
        assert httpx.post(server.url + "/resume", headers=ADMIN, timeout=60).status_code == 200
        t.join(120)
        assert held[99][0] == 200 and held[99][2][-1] == "data: [DONE]"

        # kill -9 one API server: the launcher stops everything, nothing is left behind
        api_servers = children_of(server.proc.pid)
        victim = next(pid for pid in api_servers if "run_api_server" in Path(f"/proc/{pid}/cmdline").read_text())
        os.kill(victim, signal.SIGKILL)
        assert server.proc.wait(60) == 1, server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    deadline = time.monotonic() + 15
    while [p for p in procs if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]:
        assert time.monotonic() < deadline, f"processes left: {procs}"
        time.sleep(0.2)


def test_a_sleep_through_one_api_server_waits_for_an_update_through_the_other(tmp_path, default_model_path):
    """The control routes take turns across API servers as within one: while an update through
    one server waits for the trainer's bytes, a /sleep through the other waits for it, and the
    update lands whole on both replicas (before, the sleep went through at once, and the update's
    commit was refused on the replicas it reached: a 409, or replicas on different versions)."""
    from safetensors.torch import load_file

    from rollout.client import RolloutClient
    from tests.rollout.conftest import stop_server, tiny_model_folder
    from weight_sync import WeightSender, weights_checksum

    folder = tiny_model_folder(tmp_path, default_model_path)
    server = start_server(folder, "--max-model-len", "256", "--api-server-count", "2", "--data-parallel-size", "2")
    try:
        with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
            c.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=60)
            version = c.weight_version()
            here = c.http.get(server.url + "/health").headers["x-rollout-api-server"]  # (its kept connection's)
            others = [httpx.Client(timeout=120, headers=ADMIN) for _ in range(32)]
            try:
                other = next(h for h in others if h.get(server.url + "/health").headers["x-rollout-api-server"] != here)
                state = load_file(str(Path(folder) / "model.safetensors"))
                pushed = {n: t * 0.5 for n, t in state.items()}
                box = {}
                posting = threading.Thread(target=lambda: box.update(result=c.weights_update("gloo")))
                posting.start()
                time.sleep(0.5)  # (the update holds the control routes' turn, waiting for the bytes)
                sleeping = threading.Thread(target=lambda: box.update(
                    slept=other.post(server.url + "/sleep", params={"level": 1, "mode": "abort"})))
                sleeping.start()
                time.sleep(1.0)
                assert "slept" not in box, "the sleep went through during another server's update"
                WeightSender(c.weights.group).send(pushed.items())
                posting.join(120)
                sleeping.join(120)
            finally:
                for h in others:
                    h.close()
            assert box["result"]["weight_version"] == version + 1, box["result"]
            assert box["slept"].status_code == 200, box["slept"].text
            c.wake_up()
            assert c.weights_checksum() == weights_checksum(pushed.items(), torch.float32)  # (both replicas agree)
    finally:
        assert stop_server(server) == 0, server.log()


def _state(pid: int) -> str:
    try:
        return json.dumps(Path(f"/proc/{pid}/status").read_text().lower())
    except OSError:
        return "zombie"


def generate_stream(url: str, i: int, box: dict) -> None:
    body = {"prompt_token_ids": [[1, 2, 3, 100 + i]], "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 48, "ignore_eos": True}}
    with httpx.Client(timeout=600) as http:
        with http.stream("POST", url + "/generate", json=body, headers=USER) as r:
            events = [json.loads(ln) for ln in r.iter_lines() if ln]
    box[i] = (r.status_code, events)


def fresh(method: str, url: str, **kw) -> httpx.Response:
    """One call on a connection of its own: it reaches whichever API server accepts it, as the
    calls of a trainer that does not keep its connection alive do."""
    with httpx.Client(timeout=60) as http:
        return http.request(method, url, **kw)


def test_two_api_servers_share_adapters_update_keys_and_an_update_sequence(tmp_path, default_model_path):
    """What a route keeps between calls holds whichever API server a call reaches: LoRA adapters
    loaded at run time serve by name through both (greedy token-exact against PEFT), under ids
    that never collide (the engine keeps the first adapter of an id: two adapters loaded through
    two servers served the first one's weights under both names); an unloaded name is a 404
    through both; a retried /weights/update gets the first answer through either; a
    /start_weight_update through one is seen through the other."""
    import shutil

    from transformers import AutoTokenizer

    from rollout.subprocess_server import served
    from tests.engine.test_lora import build_models, reference

    folder, _, adapters = build_models(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path) / name, Path(folder) / name)
    prompt, greedy = [5, 6, 7, 8, 9], {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    with served(folder, "--dtype", "float32", "--api-server-count", "2", "--lora-modules", f"first={adapters[0][0]}",
                log_path=tmp_path / "serve.log") as server:
        url = server.url
        for name, (path, _) in (("second", adapters[1]), ("third", adapters[2])):
            r = fresh("POST", url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert r.status_code == 200, r.text
        tokenizer = AutoTokenizer.from_pretrained(folder)
        answered = set()
        for name, (_, peft) in zip(("first", "second", "third"), adapters):
            want = tokenizer.decode(reference(peft, prompt))
            for _ in range(8):
                r = fresh("POST", url + "/v1/completions", json={"model": name, "prompt": prompt, **greedy})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (name, r.text)
                answered.add(r.headers["x-rollout-api-server"])
        for _ in range(8):
            r = fresh("GET", url + "/v1/models")
            assert [m["id"] for m in r.json()["data"]][1:] == ["first", "second", "third"]
            answered.add(r.headers["x-rollout-api-server"])

        assert fresh("POST", url + "/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200
        for _ in range(8):
            r = fresh("POST", url + "/v1/completions", json={"model": "second", "prompt": prompt, **greedy})
            assert r.status_code == 404, r.text
            answered.add(r.headers["x-rollout-api-server"])

        update = {"source": "disk", "path": str(folder), "idempotency_key": "step-1"}
        first = fresh("POST", url + "/weights/update", json=update)
        assert first.status_code == 200 and first.json()["weight_version"] == 1, first.text
        for _ in range(8):  # the trainer's retries: the first answer, through either server, and no second update
            r = fresh("POST", url + "/weights/update", json=update)
            assert r.status_code == 200 and r.json()["replayed"] is True and r.json()["weight_version"] == 1, r.text
            answered.add(r.headers["x-rollout-api-server"])
            r = fresh("GET", url + "/weights/update", params={"idempotency_key": "step-1"})
            assert r.json()["status"] == "done", r.text

        assert fresh("POST", url + "/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
        for _ in range(8):  # a relabel inside a start .. finish sequence is refused, through either server
            r = fresh("POST", url + "/update_weight_version", json={"new_version": 7})
            assert r.status_code == 409 and "in progress" in r.text, r.text
            answered.add(r.headers["x-rollout-api-server"])
        assert fresh("GET", url + "/weights/version").json()["weight_version"] == 1
        assert answered == {"0", "1"}, answered  # (the calls did reach both servers)


def test_scale_1_2_1_while_32_requests_stream():
    """/scale grows to 2 replicas (the new one holds the weights pushed since start-up: same
    checksum, and /ready counts it at that version) and back to 1 while 32 requests stream: none lost, none duplicated, all complete."""
    from rollout.client import RolloutClient

    server = start_server()
    try:
        with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=300) as client:
            path = client.server_info()["model_path"]
            assert client.push_weights_from_disk(path, version=2)["weight_version"] == 2
            live = client.weights_checksum()
            box: dict = {}
            threads = [threading.Thread(target=generate_stream, args=(server.url, i, box)) for i in range(32)]
            for t in threads[:16]:
                t.start()
            assert client.scale(2) == {"data_parallel_size": 2, "added": [1], "removed": []}
            assert client.weights_checksum() == live  # both replicas (the server checks they agree)
            # the new replica is ready at the version pushed before it existed
            assert [(r["replica"], r["weight_version"]) for r in client.ready(min_weight_version=2)["replicas"]] == \
                [(0, 2), (1, 2)]
            assert client.get_world_size() == 2
            for t in threads[16:]:
                t.start()
            time.sleep(1.0)
            assert client.scale(1, drain_timeout_s=300) == {"data_parallel_size": 1, "added": [], "removed": [1]}
            for t in threads:
                t.join(600)
            health = httpx.get(server.url + "/health", timeout=30).json()
            assert health == {"status": "ok"}, health
        assert sorted(box) == list(range(32))
        for code, events in box.values():
            assert code == 200
            tokens = [t for e in events for o in e["outputs"] for t in o["token_ids"]]
            assert len(tokens) == 48, len(tokens)  # complete, no token twice or lost
            assert events[-1]["outputs"][0]["finish_reason"] == "length"
            assert {v for e in events for o in e["outputs"] for v in o["weight_versions"]} == {2}
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()


def engine_cores_under(pid: int) -> list[int]:
    return [p for p in descendants(pid) if "run_engine_core" in _cmdline(p)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def all_gone(pids: list[int], within_s: float) -> list[int]:
    """The processes of `pids` still alive (not zombies) after `within_s` seconds ([] once all exit)."""
    deadline = time.monotonic() + within_s
    while True:
        left = [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_scale_beyond_the_machine_then_sigterm_during_a_scale_up():
    """/scale to 1000 replicas: 400 naming data_parallel_size within a second, nothing started; a
    SIGTERM while a scale-up starts its replica: the whole process tree is gone within 10 s."""
    server = start_server()
    try:
        before = descendants(server.proc.pid)
        t0 = time.monotonic()
        r = httpx.post(server.url + "/scale", json={"data_parallel_size": 1000}, headers=ADMIN, timeout=30)
        assert time.monotonic() - t0 < 1.0
        assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_size", r.text
        assert "CPU core" in r.json()["error"]["message"]
        assert descendants(server.proc.pid) == before

        scaling = threading.Thread(target=lambda: httpx.post(server.url + "/scale", json={"data_parallel_size": 2},
                                                             headers=ADMIN, timeout=120), daemon=True)
        scaling.start()
        deadline = time.monotonic() + 30
        while len(engine_cores_under(server.proc.pid)) < 2:  # the new replica is starting
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.02)
        tree = descendants(server.proc.pid)
        server.proc.send_signal(signal.SIGTERM)
        assert all_gone([server.proc.pid, *tree], 10) == [], server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_server_stopped_while_its_cores_start_leaves_nothing(sig, tmp_path):
    from rollout.subprocess_server import rollout_command

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(rollout_command() + ["serve", "--port", "0", "-dp", "2", "--dtype", "float32"],
                                stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(engine_cores_under(proc.pid)) < 2:  # both are importing, loading or in the handshake
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.02)
        tree = descendants(proc.pid)
        proc.send_signal(sig)
        assert all_gone([proc.pid, *tree], 10) == [], (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_each_dead_replica_logs_one_line():
    """Both replicas of -dp 2 killed one after the other under load and polling: the log says
    "engine core N died" once for each, and no "Future exception was never retrieved" at all."""
    server = start_server("-dp", "2", "--stay-up-when-engine-dies", "--stats-interval-s", "0.2")
    try:
        streams = [threading.Thread(target=stream, args=(server.url, i, {}), daemon=True) for i in range(8)]
        for t in streams:
            t.start()
        for _ in range(2):
            time.sleep(1.0)
            os.kill(engine_cores_under(server.proc.pid)[0], signal.SIGKILL)
            for _ in range(20):  # what a trainer and Prometheus keep asking meanwhile
                httpx.get(server.url + "/metrics", headers=USER, timeout=30)
                httpx.get(server.url + "/health", timeout=30)
                httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=USER,
                           timeout=30)
                time.sleep(0.05)
        for t in streams:
            t.join(60)
    finally:
        try:
            server.stop(60)  # SIGTERM; killed if it does not stop
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not stop within 60 s of SIGTERM:\n" + server.log())
    log = Path(server.log_path).read_text()
    assert "never retrieved" not in log, log[-4000:]
    assert sorted(line.split("engine core ")[1].split()[0] for line in log.splitlines()
                  if "died (exit code" in line and "ERROR" in line) == ["0", "1"], log[-4000:]
