"""LoRA adapters from PEFT folders: three adapters and the base model in one batch, each greedy
token-exact against PEFT on transformers (float32, random LoRA weights that change the outputs), and
in bf16 as close to PEFT in float32 as PEFT in bf16 is; the deltas through the float32 panels against
float64; the prefix cache keyed by adapter; bad adapters refused with nothing changed; max_loras eviction
(least recently used, never a pinned one)."""
import copy
import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, EngineStateError, InvalidRequestError, SamplingParams
from engine.worker.lora import LoRARequest, PanelDelta
from kernels import cpu_ext
from tests.engine.hf_reference import hf_prompt_logprobs
from weight_sync import SharedWeights

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


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_three_adapters_and_the_base_in_one_batch_equal_peft(models, default_model_path, async_scheduling):
    folder, base, adapters = models
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32", enable_lora=True,
              async_scheduling=async_scheduling)
    try:
        loras = [None] + [LoRARequest(f"a{k}", k + 1, path) for k, (path, _) in enumerate(adapters)]
        # the base model first, alone: its prefix-cache blocks must not serve the adapters
        alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        prompts = [p for p in PROMPTS for _ in loras]
        lora_of = [r for _ in PROMPTS for r in loras]
        worker, asked = llm.client.core.executor.worker, []
        worker.list_loras = lambda list_loras=worker.list_loras: asked.append(1) or list_loras()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora_of)
        # the core asks which adapters the worker holds after it loads some, not every step (with
        # async scheduling the question would wait for the step in flight)
        assert 1 <= len(asked) <= 2
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


@pytest.mark.skipif(not (cpu_ext.load() and cpu_ext.load().f32_panel_supported()),
                    reason="the float32 panels need AVX-512 or AVX2 + FMA and the C++ kernels")
def test_panel_delta_is_the_float64_delta_rounded_once():
    """PanelDelta (LoRA on CPUs whose model linears run on the float32 panels), in bf16: y + (x @ At)
    @ Bt in float32 and one rounding, for one adapter and for a stack of adapters masked per row,
    against the same math in float64 (bf16 inputs are exact in both)."""
    ext, g = cpu_ext.load(), torch.Generator().manual_seed(0)
    shapes = [(1, 64, 4, 96), (5, 576, 48, 960), (33, 1536, 16, 576), (70, 64, 1, 40)]  # rows, in, rank, out
    for rows, hidden, rank, width in shapes:
        x = torch.randn(rows, hidden, generator=g).bfloat16()
        At = (torch.randn(hidden, rank, generator=g) * 0.1).bfloat16()
        Bt = (torch.randn(rank, width, generator=g) * 0.1).bfloat16()
        y = torch.randn(rows, width, generator=g).bfloat16()
        owner = torch.randint(0, 3, (1, rank), generator=g)
        row_owner = torch.randint(-1, 3, (rows, 1), generator=g)
        delta = PanelDelta(ext, At, Bt)
        for mask in (None, owner != row_owner):
            got = y.clone().add_(delta(x, mask))
            keep = 1.0 if mask is None else (~mask).double()
            exact_delta = ((x.double() @ At.double()) * keep) @ Bt.double()
            exact = y.double() + exact_delta
            # float64's sum rounded to bf16, but for the float32 sums' error (~2^-24 of the terms'
            # size; it shows where y and the delta cancel) and values a hair from a rounding boundary
            off = (got.double() - exact.bfloat16().double()).abs()
            assert got.dtype == torch.bfloat16 and (off > 0).float().mean() < 0.01
            assert (off <= exact.abs() * 2 ** -7 + (y.double().abs() + exact_delta.abs()) * 2 ** -16).all()


def test_bf16_adapters_and_the_base_in_one_batch_stay_as_close_to_peft_as_peft_in_bf16(models, default_model_path):
    """In bf16 (where this CPU has no AVX-512 BF16, the deltas go through PanelDelta): three
    adapters and the base model in one batch, each row's prompt logprobs against PEFT in float32
    no further off than PEFT's own bf16 run is (plus a bf16 step)."""
    folder, base, adapters = models
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="bfloat16", enable_lora=True)
    try:
        loras = [None] + [LoRARequest(f"a{k}", k + 1, path) for k, (path, _) in enumerate(adapters)]
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * len(loras), params, use_tqdm=False,
                            lora_request=loras)
        for r, o in zip(loras, outs):
            model = base if r is None else adapters[r.lora_int_id - 1][1]
            ref = torch.tensor(hf_prompt_logprobs(model, PROMPTS[1]))
            peft_bf16 = torch.tensor(hf_prompt_logprobs(copy.deepcopy(model).to(torch.bfloat16), PROMPTS[1]))
            ours = torch.tensor(o.prompt_logprobs[1:])
            assert (ours - ref).abs().max() <= 2 * (peft_bf16 - ref).abs().max() + 0.02, r
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


def perturbed(model, seed: int):
    """A copy of a PEFT model with every lora_B changed (what a training step does)."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def lora_tensors(model, only: str = "lora_B"):
    """The trainer's view: named_parameters() with PEFT's adapter-name segment (lora_B.default.weight)."""
    return [(n, p.detach().clone()) for n, p in model.named_parameters() if only in n]


def test_a_lora_push_changes_only_that_adapter(models, default_model_path, tmp_path):
    folder, base, adapters = models
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32", enable_lora=True,
              max_loras=2)
    try:
        a, b = (LoRARequest(f"a{k}", k + 1, adapters[k][0]) for k in range(2))
        loras = [None, a, b]

        def run():
            outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * 3, GREEDY, use_tqdm=False, lora_request=loras)
            return [o.outputs[0] for o in outs]

        before = run()
        assert [c.lora_versions for c in before] == [[], [0] * 12, [0] * 12]
        trained = perturbed(adapters[0][1], 1)
        assert reference(trained, PROMPTS[1]) != before[1].token_ids  # the push must show
        llm.pause_generation()
        result = llm.update_weights_from_tensors(lora_tensors(trained), version=5, lora_id=1)
        llm.resume_generation()
        assert result["weight_version"] == 5 and llm.get_weight_version(lora_id=1) == 5
        assert llm.get_weight_version() == 0  # the base model's version is untouched
        after = run()
        assert after[1].token_ids == reference(trained, PROMPTS[1]) and after[1].lora_versions == [5] * 12
        assert after[0].token_ids == before[0].token_ids and after[0].weight_versions == [0] * 12
        assert after[2].token_ids == before[2].token_ids and after[2].lora_versions == [0] * 12
        # pushed weights exist nowhere else: the adapter is pinned, a third adapter evicts b instead
        llm.add_lora(LoRARequest("a2", 3, adapters[2][0]))
        assert llm.list_loras() == [1, 3]

        # refused, nothing changes: unknown tensor, wrong shape, a version that does not increase,
        # an adapter that was never registered, a folder that is not an adapter
        name, t = lora_tensors(trained)[0]
        with pytest.raises(InvalidRequestError, match="has no tensor"):
            llm.update_weights_from_tensors([(name.replace("q_proj", "k_proj"), t)], lora_id=1)
        with pytest.raises(InvalidRequestError, match="shape"):
            llm.update_weights_from_tensors([(name, t[:, :2])], lora_id=1)
        with pytest.raises(EngineStateError, match="must increase"):
            llm.update_weights_from_tensors([(name, t * 0)], version=5, lora_id=1)
        with pytest.raises(InvalidRequestError, match="not loaded"):
            llm.update_weights_from_tensors([(name, t)], lora_id=9)
        with pytest.raises(InvalidRequestError, match="adapter_config.json"):
            llm.update_weights_from_disk(str(tmp_path), lora_id=1)
        assert llm.get_weight_version(lora_id=1) == 5
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0]
        assert out.token_ids == after[1].token_ids

        # a whole PEFT folder from disk (what a trainer saves), with the default version (+1)
        trained2 = perturbed(adapters[0][1], 2)
        trained2.save_pretrained(tmp_path / "step2")
        assert llm.update_weights_from_disk(str(tmp_path / "step2"), lora_id=1)["weight_version"] == 6
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0]
        assert out.token_ids == reference(trained2, PROMPTS[1]) and out.lora_versions == [6] * 12

        # shared memory (a trainer on this machine), lora_A and lora_B together
        with SharedWeights() as shared:
            handles = shared.share(lora_tensors(trained, "lora_"))
            assert llm.update_weights_from_ipc(handles, lora_id=1)["weight_version"] == 7
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0]
        assert out.token_ids == reference(trained, PROMPTS[1]) and out.lora_versions == [7] * 12
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_more_adapters_in_use_than_max_loras_wait_for_a_slot(models, default_model_path, tmp_path, async_scheduling):
    """Three registered adapters over max_loras 2, nine requests naming them in turn, all in one
    batch: every request runs (an evicted adapter is reloaded from its folder when a request needs
    it; a request whose adapter has no free slot waits), each token-exact with its run alone. Then
    the same with one adapter pinned (it keeps a slot, the other two take turns in the last one).
    An evicted adapter whose folder went away fails its requests with the loader's error; the engine
    serves on. With async scheduling too: an adapter a step needs loads after the step in flight
    (which may be using the one it evicts)."""
    folder, _, adapters = models
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32", enable_lora=True,
              max_loras=2, async_scheduling=async_scheduling)
    try:
        loras = [LoRARequest(f"a{k}", k + 1, path) for k, (path, _) in enumerate(adapters)]
        alone = {r.lora_int_id: llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False,
                                             lora_request=r)[0].outputs[0].token_ids for r in loras}
        assert len(set(map(tuple, alone.values()))) == 3  # the adapters differ
        lora_of = [loras[i % 3] for i in range(9)] + [None]
        for pin in (None, 2):
            if pin is not None:
                assert llm.pin_lora(pin)
            outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * len(lora_of), GREEDY, use_tqdm=False,
                                lora_request=lora_of)
            for r, o in zip(lora_of, outs):
                if r is not None:
                    assert o.outputs[0].token_ids == alone[r.lora_int_id], (pin, r)
            assert len(llm.list_loras()) <= 2
            if pin is None:
                gone = tmp_path / "gone"
                shutil.copytree(adapters[2][0], gone)
                assert llm.add_lora(LoRARequest("gone", 4, str(gone)))
                llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, use_tqdm=False, lora_request=loras[:2])
                assert 4 not in llm.list_loras()  # evicted
                shutil.rmtree(gone)
                with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
                    llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False,
                                 lora_request=LoRARequest("gone", 4, str(gone)))
                assert llm.remove_lora(4)
        # every slot pinned: a request for a third adapter could never run, so it is refused
        assert llm.pin_lora(1)
        with pytest.raises(EngineStateError, match="pinned"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=loras[2])
        assert llm.remove_lora(3)  # unregistered: the engine no longer knows the id
        with pytest.raises(InvalidRequestError, match="not loaded"):
            llm.get_weight_version(lora_id=3)
    finally:
        llm.shutdown()
