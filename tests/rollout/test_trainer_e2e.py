"""End to end, the way RL teams run it: `rollout serve` in one process, a trainer in another,
talking only HTTP (+ the gloo broadcast). After a push of perturbed weights, the service's
greedy outputs equal transformers' on those weights and carry weight version 1. With our client,
the server's W&B run (offline) shows the throughput and the weight version going 0 -> 1, and
the trainer's own W&B run holds the push's timing."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.engine.hf_reference import CHATS, chat_token_ids, hf_greedy
from tests.engine.perturb import hf_model_with, perturbed_state
from tests.rollout.conftest import ADMIN_KEY, API_KEY, REPO_ROOT, start_server, stop_server, wandb_history


@pytest.fixture(scope="module")
def reference(default_model_path):
    from transformers import AutoTokenizer

    prompts = chat_token_ids(AutoTokenizer.from_pretrained(default_model_path), CHATS[:3])
    model = hf_model_with(default_model_path, perturbed_state(default_model_path))
    return prompts, [r[0] for r in hf_greedy(model, prompts, 16)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["client", "vllm"])
def test_trainer_process_pushes_weights_over_http(mode, reference, tmp_path, monkeypatch):
    prompts, expected = reference
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for k, v in dict(wandb_env, WANDB_DIR=str(tmp_path / "server")).items():
        monkeypatch.setenv(k, v)
    (tmp_path / "server").mkdir()
    (tmp_path / "trainer").mkdir()
    server = start_server(*(["--wandb-project", "rollout-test", "--wandb-interval-s", "0.5"] if mode == "client" else []))
    try:
        out = subprocess.run([sys.executable, "-m", "tests.rollout.trainer_e2e", server.url, API_KEY, ADMIN_KEY, mode,
                              json.dumps(prompts)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_DIR=str(tmp_path / "trainer")))
        assert out.returncode == 0, out.stderr[-3000:] + server.log()
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        time.sleep(1.5)  # a stats poll and a W&B point after the push
    finally:
        assert stop_server(server) == 0
    assert seen["version"] == 1
    assert seen["after"] == expected, "outputs after the push differ from transformers on the pushed weights"
    assert seen["before"] != seen["after"]
    assert all(v == [1] * 16 for v in seen["after_versions"])
    assert all(len(lp) == 16 and all(x <= 0 for x in lp) for lp in seen["after_logprobs"])
    if mode != "client":
        return
    rows = wandb_history(tmp_path / "server")
    versions = [r["engine/weight_version"] for r in rows]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions), versions
    assert max(r["engine/throughput_tokens_per_s"] for r in rows) > 0
    [trainer_row] = [r for r in wandb_history(tmp_path / "trainer") if "rollout/push_seconds" in r]
    assert trainer_row["train/step"] == 1 and trainer_row["rollout/weight_version"] == 1
    assert 0 < trainer_row["rollout/push_seconds"] < 120 and trainer_row["rollout/push_gb_per_s"] > 0
