"""LoRA adapters from PEFT folders: three adapters and the base model in one batch, each greedy
token-exact against PEFT on transformers (float32, random LoRA weights that change the outputs);
the prefix cache keyed by adapter; bad adapters refused with nothing changed; max_loras eviction
(least recently used, never a pinned one)."""
import copy
import json
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, EngineStateError, InvalidRequestError, SamplingParams
from engine.lora import LoRARequest

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, max_position_embeddings=256)
TARGETS = (["q_proj", "v_proj"], ["o_proj", "down_proj", "gate_proj"], "all-linear")
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def build_models(root: Path):
    """(base folder, base model, [(adapter folder, PEFT model)]): a tiny random Llama and three
    adapters with random A and B (PEFT's default init leaves B zero: no effect)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).eval()
    base.save_pretrained(root / "base")
    adapters = []
    for k, targets in enumerate(TARGETS):
        config = peft.LoraConfig(r=4 + 4 * k, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        model = peft.get_peft_model(copy.deepcopy(base), config).eval()  # random A and B: outputs change
        model.save_pretrained(root / f"a{k}")
        adapters.append((str(root / f"a{k}"), model))
    return str(root / "base"), base, adapters


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("lora"))


def reference(model, prompt):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_three_adapters_and_the_base_in_one_batch_equal_peft(models, default_model_path):
    folder, base, adapters = models
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32", enable_lora=True)
    try:
        loras = [None] + [LoRARequest(f"a{k}", k + 1, path) for k, (path, _) in enumerate(adapters)]
        # the base model first, alone: its prefix-cache blocks must not serve the adapters
        alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        prompts = [p for p in PROMPTS for _ in loras]
        lora_of = [r for _ in PROMPTS for r in loras]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora_of)
        got = {}
        for p, r, o in zip(prompts, lora_of, outs):
            model = base if r is None else adapters[r.lora_int_id - 1][1]
            assert o.outputs[0].token_ids == reference(model, p), (r, p)
            got[(r.lora_int_id if r else 0, len(p))] = o.outputs[0].token_ids
        assert got[(0, len(PROMPTS[1]))] == alone
        assert len({tuple(v) for k, v in got.items() if k[1] == len(PROMPTS[1])}) > 1  # the adapters matter
        assert llm.list_loras() == [1, 2, 3]
    finally:
        llm.shutdown()


def test_bad_adapters_are_refused_and_change_nothing(models, default_model_path, tmp_path):
    folder, _, adapters = models
    good = adapters[0][0]
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32", enable_lora=True,
              max_lora_rank=8)
    try:
        with pytest.raises(InvalidRequestError, match="rank 12 is above max_lora_rank 8"):
            llm.add_lora(LoRARequest("big", 1, adapters[2][0]))
        with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
            llm.add_lora(LoRARequest("missing", 2, str(tmp_path / "nowhere")))
        odd = tmp_path / "odd"
        odd.mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (odd / name).write_bytes((Path(good) / name).read_bytes())
        cfg = json.loads((odd / "adapter_config.json").read_text())
        (odd / "adapter_config.json").write_text(json.dumps(dict(cfg, target_modules=["q_proj", "embed_tokens"])))
        with pytest.raises(InvalidRequestError, match="target_modules"):
            llm.add_lora(LoRARequest("odd", 3, str(odd)))
        (odd / "adapter_config.json").write_text((Path(good) / "adapter_config.json").read_text())
        (odd / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        with pytest.raises(InvalidRequestError, match="cannot be read"):
            llm.add_lora(LoRARequest("corrupt", 4, str(odd)))
        assert llm.list_loras() == []
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 12  # still serving
    finally:
        llm.shutdown()


def test_max_loras_evicts_the_least_recently_used_unpinned(models, default_model_path):
    folder, _, adapters = models
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32", enable_lora=True,
              max_loras=2)
    try:
        a, b, c = (LoRARequest(f"a{k}", k + 1, path) for k, (path, _) in enumerate(adapters))
        assert llm.add_lora(a) and llm.add_lora(b) and not llm.add_lora(a)
        assert llm.pin_lora(1)
        llm.add_lora(c)  # evicts 2 (1 is pinned)
        assert llm.list_loras() == [1, 3]
        assert llm.remove_lora(3) and llm.list_loras() == [1]
    finally:
        llm.shutdown()
    off = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32")
    try:
        with pytest.raises(EngineStateError, match="enable_lora"):
            off.add_lora(a)
    finally:
        off.shutdown()
