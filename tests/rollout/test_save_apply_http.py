"""POST /save_weights and POST /apply_model through RolloutClient / AsyncRolloutClient, on a real
`rollout serve` of a tiny random Llama with API keys on.

/save_weights writes the live weights (a push included) as a Hugging Face folder on the server's
disk: transformers loads it and generates the server's greedy tokens; a folder that exists and is
not empty is a 400 naming `path` and stays as it was, unless overwrite. /apply_model runs only the
functions the server was started with (--apply-model-fn, as /collective_rpc runs only
--collective-rpc-method ones): another is a 403 naming `fn`, and both routes need the admin key.
The engine-level contracts (and the vLLM sources they follow) are in
tests/engine/test_save_weights.py and tests/engine/test_apply_model.py.
"""
import asyncio

import pytest
from safetensors.torch import save_file

from rollout.client import AsyncRolloutClient, RolloutAPIError, RolloutClient
from rollout.subprocess_server import served
from tests.rollout.conftest import tiny_model_folder
from tests.engine import model_fns
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.engine.perturb import perturbed_state
from weight_sync import load_safetensors_folder, weights_checksum

USER, ADMIN = "user-key", "admin-key"
NUM_LAYERS = "tests.engine.model_fns:num_layers"
SUMMARY = "tests.engine.model_fns.embedding_summary"  # (the dotted form registers it too)
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny_served"), default_model_path)
    with served(folder, "--dtype", "float32", "--api-key", USER, "--admin-api-key", ADMIN,
                "--apply-model-fn", NUM_LAYERS, "--apply-model-fn", SUMMARY,
                log_path=tmp_path_factory.mktemp("logs") / "serve.log") as s:
        s.model_folder = str(folder)
        yield s


@pytest.fixture(scope="module")
def client(server):
    with RolloutClient(server.url, api_key=USER, admin_api_key=ADMIN, timeout=120) as c:
        yield c


def test_save_weights_after_a_push(server, client, tmp_path):
    pushed = tmp_path / "pushed"
    pushed.mkdir()
    save_file({k: v.contiguous() for k, v in perturbed_state(server.model_folder).items()}, pushed / "model.safetensors")
    assert client.push_weights_from_disk(str(pushed), version=5)["weight_version"] == 5

    out = tmp_path / "step_5"
    saved = client.save_weights(str(out))
    assert saved["path"] == str(out) and saved["weight_version"] == 5 and saved["files"] == ["model.safetensors"]
    assert weights_checksum(load_safetensors_folder(out)) == client.weights_checksum()
    prompt = [1, 300, 4000, 12, 7]
    served_tokens = client.generate([prompt], GREEDY)[0].token_ids
    assert hf_greedy(load_hf(str(out)), [prompt], 8)[0][0] == served_tokens

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RolloutAPIError) as e:
        client.save_weights(str(out))
    assert e.value.status == 400 and e.value.param == "path" and "not empty" in str(e.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(RolloutAPIError) as e:
        client.save_weights(str(tmp_path / "other"), max_shard_bytes=0)
    assert e.value.status == 400 and e.value.param == "max_shard_bytes"
    assert client.save_weights(str(out), overwrite=True, max_shard_bytes=1_000_000)["files"][-1] == \
        "model.safetensors.index.json"
    assert not (out / "model.safetensors").exists()


def test_apply_model_runs_registered_functions_only(server, client):
    assert client.apply_model(NUM_LAYERS) == [2]
    assert client.apply_model(model_fns.num_layers) == [2]
    [summary] = client.apply_model(SUMMARY)
    assert summary["shape"] == [49152, 64] and len(summary["row0"]) == 64  # a tensor, as a list
    for fn in ("tests.engine.model_fns:Probes.hidden_size", "os:getcwd", "builtins:print"):
        with pytest.raises(RolloutAPIError) as e:
            client.apply_model(fn)
        assert e.value.status == 403 and e.value.param == "fn" and "--apply-model-fn" in str(e.value)
    with pytest.raises(RolloutAPIError) as e:  # the worker method itself is not a collective_rpc method
        client.collective_rpc("apply_model", [NUM_LAYERS])
    assert e.value.status == 403


def test_admin_key_and_the_async_client(server, tmp_path):
    with RolloutClient(server.url, api_key=USER, timeout=60) as user:
        for call in (lambda: user.apply_model(NUM_LAYERS), lambda: user.save_weights(str(tmp_path / "x"))):
            with pytest.raises(RolloutAPIError) as e:
                call()
            assert e.value.status == 403
    assert not (tmp_path / "x").exists()

    async def admin_calls():
        async with AsyncRolloutClient(server.url, api_key=USER, admin_api_key=ADMIN, timeout=60) as c:
            return await c.apply_model(NUM_LAYERS), await c.save_weights(str(tmp_path / "async"))

    layers, saved = asyncio.run(admin_calls())
    assert layers == [2] and (tmp_path / "async" / "config.json").is_file() and saved["tensors"] == 21


def test_server_config_registers_functions_not_the_worker_method():
    from rollout.config import ServerConfig

    config = ServerConfig(apply_model_fns=(NUM_LAYERS,))
    assert config.allows_apply_model("tests.engine.model_fns.num_layers") and not config.allows_apply_model("os:getcwd")
    for kwargs, words in [({"collective_rpc_methods": ("apply_model",)}, "--apply-model-fn"),
                          ({"apply_model_fns": ("nodots",)}, "import path")]:
        with pytest.raises(ValueError, match=words):
            ServerConfig(**kwargs)
