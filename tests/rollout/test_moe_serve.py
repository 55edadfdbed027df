"""`rollout serve MOE_FOLDER -dp 2 --enable-expert-parallel`: a real server whose two replicas split
a tiny random Qwen3-MoE's experts answers /generate with transformers' greedy tokens (float32),
pushes by tensors reach both replicas' experts, and what expert parallelism does not cover
(/scale, save) is refused with a clear error while serving goes on."""
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from rollout.client import RolloutClient
from rollout.subprocess_server import served
from tests.engine.test_tiny_models import build_model, hf_greedy, make_prompts
from tests.rollout.conftest import REPO_ROOT

MAX_TOKENS = 8


@pytest.mark.slow
def test_serve_expert_parallel(tmp_path, default_model_path):
    folder = tmp_path / "qwen3_moe"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build_model("qwen3_moe", folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path) / name, folder / name)
    prompts = make_prompts()[:3]
    refs = [hf_greedy(model, p)[0][:MAX_TOKENS] for p in prompts]
    torch.set_num_threads(threads)
    with served(str(folder), "--dtype", "float32", "-dp", "2", "--enable-expert-parallel", "--num-threads", "1",
                "--kv-cache-memory", "32MiB", log_path=tmp_path / "serve.log", cwd=REPO_ROOT) as server:
        client = RolloutClient(server.url)
        outs = client.generate(prompts, {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True})
        assert [o.token_ids for o in outs] == refs
        r = httpx.post(f"{server.url}/scale", json={"data_parallel_size": 3}, timeout=60)
        assert r.status_code in (400, 409) and "expert-parallel" in r.text, r.text
        r = httpx.post(f"{server.url}/save_weights", json={"path": str(tmp_path / "saved")}, timeout=60)
        assert r.status_code in (400, 409) and "expert-parallel" in r.text, r.text
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert [o.token_ids for o in client.generate(prompts, {"temperature": 0, "max_tokens": MAX_TOKENS,
                                                               "ignore_eos": True})] == refs
