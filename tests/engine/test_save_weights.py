"""save_weights: the live weights (pushes included) as a Hugging Face folder that transformers
loads, and nothing half written.

vLLM has no Hugging Face writer of its own; the verb follows what it has: the engine core hands
the call to the workers (vLLM v1 `EngineCore.save_sharded_state(path, pattern, max_size)` ->
`collective_rpc("save_sharded_state", ...)`, vllm/v1/engine/core.py and
vllm/v1/executor/abstract.py) and takes rank 0's answer. The folder is laid out as
transformers' `save_pretrained` lays it out: huggingface_hub's `split_torch_state_dict_into_shards`
(files filled in order, `model-00001-of-0000N.safetensors`, a `model.safetensors.index.json` with
`metadata.total_size` and `weight_map`; MAX_SHARD_SIZE "5GB" is our default limit), safetensors
metadata {"format": "pt"}, config.json with `torch_dtype`.
"""
import json
import os
from pathlib import Path

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards

from engine import LLM, EngineStateError, InvalidRequestError, SamplingParams
from engine.worker.hf_export import check_target, save_hf_folder
from tests.engine.hf_reference import CHATS, chat_token_ids, hf_greedy, load_hf
from tests.engine.perturb import perturbed_state
from weight_sync import load_safetensors_folder, weights_checksum
from weight_sync.checkpoint import INDEX_NAME, save_safetensors_folder

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder, default_model_path):
    llm = LLM(tiny_folder, tokenizer=default_model_path, dtype="float32", multiprocess=False,
              kv_cache_memory=16 << 20)
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_a_saved_folder_serves_the_pushed_weights_in_transformers(default_model_path, tmp_path):
    """Push perturbed weights, save: transformers loads the folder (model and tokenizer) and its
    greedy tokens are the engine's, in float32; three shards and an index at a 200 MB limit."""
    from transformers import AutoTokenizer

    prompts = chat_token_ids(AutoTokenizer.from_pretrained(default_model_path), CHATS[:3])
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20)
    try:
        llm.update_weights_from_tensors(perturbed_state(default_model_path).items(), version=3)
        served = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        saved = llm.save_weights(tmp_path / "step_3", max_shard_bytes=200_000_000)
        checksum = llm.weights_checksum()
    finally:
        llm.shutdown()
    folder = tmp_path / "step_3"
    assert saved["path"] == str(folder) and saved["weight_version"] == 3
    assert saved["files"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX_NAME]
    assert all((folder / f).stat().st_size <= 200_000_000 for f in saved["files"])
    index = json.loads((folder / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == saved["bytes"] and len(index["weight_map"]) == saved["tensors"]
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding in this model's config
    assert weights_checksum(load_safetensors_folder(folder)) == checksum
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))

    assert chat_token_ids(AutoTokenizer.from_pretrained(folder), CHATS[:3]) == prompts
    reference = hf_greedy(load_hf(str(folder)), prompts, 16)
    assert [r[0] for r in reference] == served


def test_saves_in_the_served_dtype_and_one_file_under_the_limit(tiny_folder, default_model_path, tmp_path):
    llm = LLM(tiny_folder, tokenizer=default_model_path, dtype="bfloat16", multiprocess=False,
              kv_cache_memory=16 << 20)
    try:
        saved = llm.save_weights(str(tmp_path / "bf16"))
        checksum = llm.weights_checksum()
    finally:
        llm.shutdown()
    folder = tmp_path / "bf16"
    assert saved["files"] == ["model.safetensors"] and not (folder / INDEX_NAME).exists()
    assert {t.dtype for _, t in load_safetensors_folder(folder)} == {torch.bfloat16}
    assert weights_checksum(load_safetensors_folder(folder)) == checksum
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # the tokenizer came from its own folder (tokenizer=...), the model's files from the model's
    assert (folder / "tokenizer.json").read_bytes() == (Path(default_model_path) / "tokenizer.json").read_bytes()
    model = load_hf(str(folder), dtype=torch.bfloat16)
    assert weights_checksum(model.state_dict().items()) == checksum  # (this model has its own lm_head)


def test_a_bad_target_changes_nothing(tiny_llm, tiny_folder, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    before, model_before = tree(tmp_path), tree(Path(tiny_folder))
    for target, words in [(busy, "not empty: pass overwrite=True"), (a_file, "not a folder"),
                          (a_file / "sub", "cannot write"), (tiny_folder, "own model"),
                          (Path(tiny_folder).parent, "own model"), ("", "empty")]:
        with pytest.raises(InvalidRequestError, match=words):
            tiny_llm.save_weights(target)
    with pytest.raises(InvalidRequestError, match="max_shard_bytes") as e:
        tiny_llm.save_weights(tmp_path / "new", max_shard_bytes=0)
    assert e.value.param == "max_shard_bytes"
    with pytest.raises(InvalidRequestError, match="own model"):
        tiny_llm.save_weights(tiny_folder, overwrite=True)
    assert tree(tmp_path) == before and tree(Path(tiny_folder)) == model_before

    # an empty folder is a fine target; overwrite replaces a full one whole
    (tmp_path / "empty").mkdir()
    assert tiny_llm.save_weights(tmp_path / "empty")["files"] == ["model.safetensors"]
    tiny_llm.save_weights(busy, overwrite=True)
    assert not (busy / "keep.txt").exists() and (busy / "model.safetensors").is_file()
    assert weights_checksum(load_safetensors_folder(busy)) == tiny_llm.weights_checksum()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_refused_while_the_weights_sleep(tiny_llm, tmp_path):
    tiny_llm.sleep(1)
    try:
        with pytest.raises(EngineStateError, match="asleep"):
            tiny_llm.save_weights(tmp_path / "out")
    finally:
        tiny_llm.wake_up()
    assert not (tmp_path / "out").exists()


def test_a_failure_while_writing_leaves_no_half_folder(tiny_folder, tmp_path):
    def weights_then_failure():
        yield "a", torch.ones(4)
        raise OSError("disk full")

    for overwrite in (False, True):
        target = tmp_path / "out"
        if overwrite:
            target.mkdir()
            (target / "old.txt").write_text("old")
        before = tree(tmp_path)
        checked = check_target(str(target), overwrite, [tiny_folder])
        with pytest.raises(OSError, match="disk full"):
            save_hf_folder(checked, weights_then_failure(), tiny_folder, None, "float32")
        assert tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == (["out"] if overwrite else [])


def test_shards_as_huggingface_hub_splits_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([100, 300, 50, 250, 10, 400, 5])}
    limit = 400 * 4  # bytes: float32
    written = save_safetensors_folder(tensors.items(), tmp_path, max_shard_bytes=limit)
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=limit)
    assert written["files"][:-1] == list(split.filename_to_tensors) and written["files"][-1] == INDEX_NAME
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    loaded = dict(load_safetensors_folder(tmp_path))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    # a tensor larger than the limit gets a file of its own
    big = tmp_path / "big"
    big.mkdir()
    out = save_safetensors_folder([("a", torch.ones(2)), ("huge", torch.ones(1000)), ("b", torch.ones(2))], big,
                                  max_shard_bytes=100)
    index = json.loads((big / INDEX_NAME).read_text())["weight_map"]
    assert len(out["files"]) == 4 and index["huge"] not in (index["a"], index["b"])
