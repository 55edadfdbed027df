"""LoRA over HTTP on a real `rollout serve` (a tiny random Llama, the default model's tokenizer
copied in): an adapter given at start (--lora-modules) and one loaded at run time
(/v1/load_lora_adapter) serve as models of their names through /v1/completions and /generate,
greedy token-exact against PEFT; /v1/models lists them; a bad adapter is a 400 that changes
nothing; unloading makes the name a 404. A trainer (this process, rank 0 of a real gloo group)
pushes one adapter's tensors: only that adapter's outputs change, its tokens carry its version."""
import shutil
from pathlib import Path

import httpx
import pytest

from rollout.client import RolloutAPIError, RolloutClient
from rollout.subprocess_server import served
from tests.engine.test_lora import build_models, lora_tensors, perturbed, reference

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_path):
    root = tmp_path_factory.mktemp("lora_http")
    folder, base, adapters = build_models(root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path) / name, Path(folder) / name)
    with served(folder, "--dtype", "float32", "--lora-modules", f"first={adapters[0][0]}",
                log_path=root / "serve.log") as server:
        with RolloutClient(server.url, timeout=60) as client:
            yield client, server.url, base, adapters


def test_adapters_serve_as_models(setup):
    client, url, base, adapters = setup
    greedy = GREEDY
    assert client.generate(PROMPT, greedy, model="first")[0].token_ids == reference(adapters[0][1], PROMPT)
    assert client.load_lora_adapter("second", adapters[1][0]).startswith("Success")
    names = [m["id"] for m in client.model_info()]
    assert names[1:] == ["first", "second"] and all(m.get("parent") == names[0] for m in client.model_info()[1:])
    out = httpx.post(url + "/v1/completions", json={"model": "second", "prompt": PROMPT, **greedy}, timeout=60).json()
    assert out["choices"][0]["text"] == client.detokenize(reference(adapters[1][1], PROMPT))
    assert client.generate(PROMPT, greedy)[0].token_ids == reference(base, PROMPT)  # the base model
    with pytest.raises(RolloutAPIError) as e:  # a rank above --max-lora-rank (16)
        client.load_lora_adapter("big", str(_big_adapter(adapters[2][0], Path(adapters[2][0]).parent / "big")))
    assert e.value.status == 400 and "max_lora_rank" in str(e.value)
    assert [m["id"] for m in client.model_info()][1:] == ["first", "second"]
    client.unload_lora_adapter("second")
    with pytest.raises(RolloutAPIError) as e:
        client.generate(PROMPT, greedy, model="second")
    assert e.value.status == 404


def _big_adapter(src: str, dst: Path) -> Path:
    """A copy of an adapter that claims rank 32."""
    import json

    dst.mkdir(exist_ok=True)
    shutil.copy(Path(src) / "adapter_model.safetensors", dst)
    cfg = json.loads((Path(src) / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(dict(cfg, r=32)))
    return dst


def test_unknown_model_is_a_404(setup):
    client = setup[0]
    with pytest.raises(RolloutAPIError) as e:
        client.generate(PROMPT, {"max_tokens": 2}, model="nope")
    assert e.value.status == 404 and "first" in str(e.value)


def test_a_lora_push_over_gloo_changes_only_that_adapter(setup):
    client, url, base, adapters = setup
    assert client.load_lora_adapter("pushed", adapters[2][0]).startswith("Success")
    models = (None, "first", "pushed")
    before = {m: client.generate(PROMPT, GREEDY, model=m)[0] for m in models}
    assert before["pushed"].lora_versions == [0] * 12 and before[None].lora_versions == []
    trained = perturbed(adapters[2][1], 3)
    assert reference(trained, PROMPT) != before["pushed"].token_ids
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False)
    try:
        with pytest.raises(RolloutAPIError) as e:  # a wrong shape: refused by the engine, nothing changes
            client.push_weights([(n, t[:, :1]) for n, t in lora_tensors(trained)[:1]], lora_name="pushed")
        assert e.value.status == 400 and "shape" in e.value.message
        with pytest.raises(RolloutAPIError) as e:  # an adapter the server does not know
            client.push_weights(lora_tensors(trained), lora_name="nope")
        assert e.value.status == 404
        assert client.generate(PROMPT, GREEDY, model="pushed")[0].token_ids == before["pushed"].token_ids
        result = client.push_weights(lora_tensors(trained), version=7, lora_name="pushed")
        assert result["weight_version"] == 7 and result["num_sends"] == 1
    finally:
        client.close_weight_transfer()
    after = {m: client.generate(PROMPT, GREEDY, model=m)[0] for m in models}
    assert after["pushed"].token_ids == reference(trained, PROMPT) and after["pushed"].lora_versions == [7] * 12
    for m in (None, "first"):
        assert after[m].token_ids == before[m].token_ids, m
    assert after[None].weight_versions == before[None].weight_versions  # the model's version is untouched
    assert client.weight_version("pushed") == 7 and client.weight_version() == before[None].weight_versions[0]
    out = httpx.post(url + "/v1/completions", json={"model": "pushed", "prompt": PROMPT, "return_token_ids": True,
                                                    **GREEDY}, timeout=60).json()
    assert out["choices"][0]["lora_versions"] == [7] * 12
    # a PEFT folder on the server's disk: the next version by default
    trained.save_pretrained(Path(adapters[2][0]).parent / "pushed_step")
    assert client.push_weights_from_disk(Path(adapters[2][0]).parent / "pushed_step",
                                         lora_name="pushed")["weight_version"] == 8
    client.unload_lora_adapter("pushed")


def test_an_adapter_cannot_take_a_name_the_model_answers_to(setup):
    client, url, _, adapters = setup
    models = client.model_info()
    for name in (models[0]["id"], client.server_info()["model_path"]):
        with pytest.raises(RolloutAPIError) as e:
            client.load_lora_adapter(name, adapters[1][0])
        assert e.value.status == 400 and e.value.param == "lora_name" and repr(name) in e.value.message
    assert [(m["id"], m["root"]) for m in client.model_info()] == [(m["id"], m["root"]) for m in models]


def test_more_adapters_in_use_than_max_loras(tmp_path_factory, default_model_path):
    """Three adapters over --max-loras 2, twelve /v1/completions naming them in turn sent at once:
    every one is a 200 (a request whose adapter has no slot waits for one in the engine; an
    evicted adapter is reloaded), token-exact with the same request run alone."""
    import asyncio

    root = tmp_path_factory.mktemp("lora_http_slots")
    folder, _, adapters = build_models(root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path) / name, Path(folder) / name)
    names = [f"a{k}" for k in range(3)]
    modules = [f"{n}={path}" for n, (path, _) in zip(names, adapters)]
    with served(folder, "--dtype", "float32", "--max-loras", "2", "--lora-modules", *modules,
                log_path=root / "serve.log") as server:

        def body(model):
            return {"model": model, "prompt": PROMPT, "return_token_ids": True, **GREEDY}

        alone = {}
        for n in names:
            r = httpx.post(server.url + "/v1/completions", json=body(n), timeout=60)
            assert r.status_code == 200, r.text
            alone[n] = r.json()["choices"][0]["token_ids"]
        assert len({tuple(v) for v in alone.values()}) == 3

        async def at_once():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*[http.post(server.url + "/v1/completions", json=body(names[i % 3]))
                                              for i in range(12)])

        for i, r in enumerate(asyncio.run(at_once())):
            assert r.status_code == 200, (i, r.text)
            assert r.json()["choices"][0]["token_ids"] == alone[names[i % 3]], i


@pytest.mark.slow  # (a server of two replicas)
def test_a_lora_push_to_replicas_here_and_elsewhere(tmp_path, default_model_path):
    """Two replicas, the second seen on another machine (its host rewritten, as a multi-node Ray
    cluster's reads; tests/rollout/test_weights.py has the full push): a LoRA push takes a
    segment of the trainer's to replica 0 and the group to replica 1, and both then serve the
    pushed adapter under its new version."""
    folder, base, adapters = build_models(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path) / name, Path(folder) / name)

    class ReplicaOneElsewhere(RolloutClient):
        def server_info(self):
            info = super().server_info()
            return dict(info, shm_host=None, replica_hosts=dict(info["replica_hosts"], **{"1": "another-machine"}))

    trained = perturbed(adapters[0][1], 3)
    with served(folder, "--dtype", "float32", "--data-parallel-size", "2", "--lora-modules",
                f"first={adapters[0][0]}", log_path=tmp_path / "serve.log") as server, \
            ReplicaOneElsewhere(server.url, timeout=120) as client:
        client.init_weight_transfer(backend="gloo", timeout_s=60)
        try:
            result = client.push_weights(lora_tensors(trained), version=3, lora_name="first")
        finally:
            client.close_weight_transfer()
        assert result["transport"] == "group+segment" and result["weight_version"] == 3
        for replica in ("0", "1"):  # (vLLM's header pins the request to that replica)
            choice = httpx.post(server.url + "/v1/completions", headers={"X-data-parallel-rank": replica},
                                json={"model": "first", "prompt": PROMPT, "return_token_ids": True, **GREEDY},
                                timeout=60).json()["choices"][0]
            assert choice["token_ids"] == reference(trained, PROMPT), replica
            assert choice["lora_versions"] == [3] * 12, replica
