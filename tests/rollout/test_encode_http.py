"""The encode routes of a real `rollout serve`: /v1/embeddings (also through the `openai` package),
/pooling and /classify, on tiny random-weight models (a causal LM and a reward-model classifier,
the default model's tokenizer copied in) against transformers in float32."""
import math
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from rollout.subprocess_server import served

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, max_position_embeddings=256, pad_token_id=0)
IDS = [[5, 6, 7, 8], list(range(100, 130))]


def save(model, folder: Path, tokenizer_from: str) -> str:
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_from) / name, folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def lm(tmp_path_factory, default_model_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    folder = save(model, tmp_path_factory.mktemp("lm"), default_model_path)
    with served(folder, "--dtype", "float32", log_path=Path(folder) / "serve.log") as server:
        yield server.url, model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, default_model_path):
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(LlamaConfig(**TINY, num_labels=1), dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    folder = save(model, tmp_path_factory.mktemp("rm"), default_model_path)
    with served(folder, "--dtype", "float32", log_path=Path(folder) / "serve.log") as server:
        yield server.url, model


def hidden(model, ids):
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


def test_embeddings_and_pooling_of_a_causal_lm(lm):
    url, model = lm
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/server_info").json()["supported_tasks"] == ["generate", "embed"]
        r = c.post("/v1/embeddings", json={"input": IDS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] == sum(map(len, IDS))
        for item, ids in zip(body["data"], IDS):
            ref = torch.nn.functional.normalize(hidden(model, ids)[-1], dim=0)
            torch.testing.assert_close(torch.tensor(item["embedding"], dtype=torch.float32), ref, rtol=0, atol=1e-5)
        r = c.post("/pooling", json={"input": IDS[1], "pooling": "mean"}).json()
        torch.testing.assert_close(torch.tensor(r["data"][0]["data"]), hidden(model, IDS[1]).mean(0), rtol=0, atol=1e-5)
        r = c.post("/classify", json={"input": "hello"})
        assert r.status_code == 400 and "serves generate, embed" in r.json()["error"]["message"]
        r = c.post("/v1/embeddings", json={"input": "hi", "dimensions": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    import openai  # the real client: it asks for base64 and decodes it

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
    name = client.models.list().data[0].id
    emb = client.embeddings.create(model=name, input=[IDS[0]]).data[0].embedding
    ref = torch.nn.functional.normalize(hidden(model, IDS[0])[-1], dim=0)
    torch.testing.assert_close(torch.tensor(emb, dtype=torch.float32), ref, rtol=0, atol=1e-5)


def test_scores_of_a_reward_model(reward_model):
    url, model = reward_model
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/server_info").json()["supported_tasks"] == ["classify"]
        with torch.no_grad():
            scores = [model(torch.tensor([ids])).logits[0, 0].item() for ids in IDS]
        r = c.post("/pooling", json={"input": IDS}).json()
        assert [len(d["data"]) for d in r["data"]] == [1, 1]
        assert [d["data"][0] for d in r["data"]] == pytest.approx(scores, abs=1e-5)
        r = c.post("/classify", json={"input": IDS}).json()
        assert [d["probs"][0] for d in r["data"]] == pytest.approx([1 / (1 + math.exp(-s)) for s in scores], abs=1e-5)
        r = c.post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400 and "serves classify" in r.json()["error"]["message"]
        r = c.post("/generate", json={"prompt_token_ids": [1, 2, 3]})
        assert r.status_code == 400 and "classifier" in r.json()["error"]["message"]
