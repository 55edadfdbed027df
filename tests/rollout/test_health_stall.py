"""/health sees an engine core that is alive but stuck: a real `rollout serve` (a tiny random
Llama) whose engine sits in one long worker call past --engine-stall-timeout-s answers 503
naming the call, and 200 again once the call returns; the server keeps serving."""
import threading
import time

import httpx

from rollout.subprocess_server import served
from tests.rollout.conftest import tiny_model_folder

EXT = "tests.engine.worker_ext.TestWorkerExtension"


def test_health_is_503_while_the_engine_is_stuck(tmp_path, default_model_path):
    folder = tiny_model_folder(tmp_path / "tiny", default_model_path)
    with served(folder, "--dtype", "float32", "--engine-stall-timeout-s", "2", "--worker-extension-cls", EXT,
                "--collective-rpc-method", "sleep_for",
                log_path=tmp_path / "serve.log") as server:
        url = server.url
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        stuck = threading.Thread(target=httpx.post, args=(url + "/collective_rpc",),
                                 kwargs={"json": {"method": "sleep_for", "args": [5.0]}, "timeout": 60})
        stuck.start()
        # polled, not read at fixed times: the stall shows 2 s into the call (seen by a heartbeat, every 1 s)
        # and clears at the first heartbeat after it
        r = httpx.get(url + "/health", timeout=10)
        while r.status_code == 200 and stuck.is_alive():
            time.sleep(0.1)
            r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and "stalled" in r.text and "collective_rpc" in r.text, r.text
        stuck.join()
        deadline = time.monotonic() + 10
        while (r := httpx.get(url + "/health", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.json() == {"status": "ok"}
        out = httpx.post(url + "/generate", json={"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}},
                         timeout=60).json()
        assert len(out["results"][0]["outputs"][0]["token_ids"]) == 2
