"""End to end, the way RL teams run it: `rollout serve` in one process, a trainer in another,
talking only HTTP (+ the gloo broadcast). After a push of perturbed weights, the service's
greedy outputs equal transformers' on those weights and carry weight version 1."""
import json
import os
import subprocess
import sys

import pytest

from tests.engine.hf_reference import CHATS, chat_token_ids, hf_greedy
from tests.engine.perturb import hf_model_with, perturbed_state
from tests.rollout.conftest import ADMIN_KEY, API_KEY, REPO_ROOT, start_server, stop_server


@pytest.fixture(scope="module")
def reference(default_model_path):
    from transformers import AutoTokenizer

    prompts = chat_token_ids(AutoTokenizer.from_pretrained(default_model_path), CHATS[:3])
    model = hf_model_with(default_model_path, perturbed_state(default_model_path))
    return prompts, [r[0] for r in hf_greedy(model, prompts, 16)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["client", "vllm"])
def test_trainer_process_pushes_weights_over_http(mode, reference):
    prompts, expected = reference
    server = start_server()
    try:
        out = subprocess.run([sys.executable, "-m", "tests.rollout.trainer_e2e", server.url, API_KEY, ADMIN_KEY, mode,
                              json.dumps(prompts)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert out.returncode == 0, out.stderr[-3000:] + server.log()
        seen = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        assert stop_server(server) == 0
    assert seen["version"] == 1
    assert seen["after"] == expected, "outputs after the push differ from transformers on the pushed weights"
    assert seen["before"] != seen["after"]
    assert all(v == [1] * 16 for v in seen["after_versions"])
    assert all(len(lp) == 16 and all(x <= 0 for x in lp) for lp in seen["after_logprobs"])
