"""Expert parallelism: a mixture-of-experts model's experts split between two data-parallel
replicas (real processes, a real gloo group between them, the coordinator's waves).

- greedy tokens and logprobs equal transformers' in float32 (tiny random Qwen3-MoE; Mixtral in the
  slow run), both replicas serving, and the checksum put together from the two replicas' experts
  equals the one transformers' tensors give;
- a gloo push from a trainer process (experts fused, as transformers holds them): a wrong shape
  changes nothing; a good one gives transformers' tokens on the new weights and the trainer's checksum;
- a random sequence of control verbs against running waves: every call answers in bounded time,
  and generation is exact afterwards.
"""
import asyncio
import json
import random
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, AsyncLLM, SamplingParams
from engine.default_model import default_model_path
from tests.engine.test_tiny_models import MAX_TOKENS, build_model, compare, hf_greedy, make_prompts
from weight_sync import WeightTransferError, checkpoint_named, find_free_port, weights_checksum

PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
CALL_TIMEOUT_S = 90  # a wedged wave would hang a call forever: any call past this fails the test


def ep_engine(folder, cls=LLM, **kw):
    return cls(str(folder), dtype="float32", data_parallel_size=2, enable_expert_parallel=True, num_threads=1,
               kv_cache_memory=32 << 20, tokenizer=str(default_model_path()), **kw)


def hf_checksum(model) -> str:
    return weights_checksum(checkpoint_named(model.state_dict().items(), model.config.model_type))


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """name -> (folder, transformers model, prompts, transformers' greedy references)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for name in ("qwen3_moe", "mixtral"):
        folder = tmp_path_factory.mktemp(name)
        model = build_model(name, folder)
        prompts = make_prompts()
        out[name] = folder, model, prompts, [hf_greedy(model, p) for p in prompts]
    torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_expert_parallel_matches_transformers(moe_models, name):
    folder, model, prompts, refs = moe_models[name]
    llm = ep_engine(folder)
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        compare(name, prompts, refs, outs)
        per_replica = [s["num_generated_tokens"] for s in llm.get_stats()["replicas"]]
        assert len(per_replica) == 2 and min(per_replica) > 0, per_replica  # both replicas served requests
        assert llm.weights_checksum() == hf_checksum(model)  # each replica's experts, put together
        with pytest.raises(Exception, match="expert-parallel"):
            llm.save_weights(str(folder / "saved"))
    finally:
        llm.shutdown()


def test_expert_parallel_refuses_what_it_does_not_cover(moe_models, tiny_folder):
    folder = moe_models["qwen3_moe"][0]
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        LLM(str(folder), tensor_parallel_size=2, tokenizer=str(default_model_path()))
    with pytest.raises(ValueError, match="LoRA"):
        LLM(str(folder), enable_lora=True, tokenizer=str(default_model_path()))
    with pytest.raises(ValueError, match="is dense"):
        LLM(tiny_folder, enable_expert_parallel=True, data_parallel_size=2, tokenizer=str(default_model_path()))


@pytest.mark.slow
def test_gloo_push_under_expert_parallel(moe_models, tmp_path):
    folder, model, prompts, _ = moe_models["qwen3_moe"]
    llm = ep_engine(folder)
    try:
        base = llm.weights_checksum()
        for mode in ("wrong_shape", "full"):
            port, out = find_free_port(), tmp_path / mode
            trainer = subprocess.Popen([sys.executable, "-m", "tests.engine.moe_trainer_proc", str(port), mode, "3",
                                        str(folder), str(out)], stdout=subprocess.PIPE, text=True)
            assert llm.init_weight_transfer("127.0.0.1", port, 3, timeout_s=60) == [1, 2]
            try:
                if mode == "full":
                    assert llm.update_weights()["weight_version"] == 1
                else:
                    with pytest.raises(WeightTransferError, match="shape"):
                        llm.update_weights()
            finally:
                llm.close_weight_transfer()
            result = json.loads(trainer.communicate(timeout=120)[0].strip().splitlines()[-1])
            if mode == "wrong_shape":
                assert not result["ok"] and llm.weights_checksum() == base
                continue
            assert result["ok"] and llm.weights_checksum() == result["checksum"]
            new = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
            outs = llm.generate(prompts, PARAMS, use_tqdm=False)
            compare("qwen3_moe pushed", prompts, [hf_greedy(new, p) for p in prompts], outs)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_random_control_verbs_against_running_waves(moe_models):
    """Requests stream into both replicas while a seeded random sequence of control verbs runs:
    pauses of every mode, resumes, sleep and wake-up, cache resets, weight updates of replicated
    and expert tensors, checksums, collective_rpc. Every call answers within CALL_TIMEOUT_S."""
    folder, model, prompts, refs = moe_models["qwen3_moe"]
    rng = random.Random(32103)
    expert = "model.layers.0.mlp.experts.6.down_proj.weight"  # replica 1's (8 experts: 0-3 and 4-7)
    norm = model.state_dict()["model.norm.weight"]

    async def main(llm):
        stop = asyncio.Event()
        finished = [0]

        async def stream(k):
            i = 0
            while not stop.is_set():
                params = SamplingParams(temperature=0, max_tokens=rng.randint(2, 12), ignore_eos=True)
                async for out in llm.generate(prompts[(k + i) % len(prompts)], params, f"s{k}-{i}"):
                    pass
                finished[0] += out.finished
                i += 1

        version = [0]

        async def update():  # (an update needs generation paused: keep the running requests)
            version[0] += 1
            name, t = rng.choice([("model.norm.weight", norm * 1.01), (expert, torch.randn(64, 32) * 0.1)])
            await llm.pause_generation("keep")
            return await llm.update_weights_from_tensors([(name, t)], version=version[0])

        verbs = {
            "pause_keep": lambda: llm.pause_generation("keep"),
            "pause_abort": lambda: llm.pause_generation("abort"),
            "pause_wait": lambda: llm.pause_generation("wait"),
            "resume": llm.resume_generation,
            "sleep": lambda: llm.sleep(1),
            "wake_up": llm.wake_up,
            "reset_prefix_cache": llm.reset_prefix_cache,
            "update": update,
            "checksum": llm.weights_checksum,
            "rpc": lambda: llm.collective_rpc("get_rank"),
        }
        streams = [asyncio.create_task(stream(k)) for k in range(4)]
        names = [rng.choice(list(verbs)) for _ in range(30)]
        succeeded, refused = set(), {}
        for name in names:
            await asyncio.sleep(rng.uniform(0, 0.05))
            try:
                await asyncio.wait_for(verbs[name](), CALL_TIMEOUT_S)
                succeeded.add(name)
            except asyncio.TimeoutError:
                pytest.fail(f"{name} did not answer within {CALL_TIMEOUT_S} s (sequence {names})")
            except Exception as e:  # a refusal in the wrong state is an answer; a hang is not
                assert "Dead" not in type(e).__name__, f"{name}: {e!r}"
                refused.setdefault(name, repr(e))
        # the verbs that meet a wave did run (the seed's sequence has each of them)
        assert {"sleep", "wake_up", "update", "pause_keep", "resume", "rpc"} <= succeeded, (refused, names)
        await asyncio.wait_for(llm.wake_up(), CALL_TIMEOUT_S)
        await asyncio.wait_for(llm.resume_generation(), CALL_TIMEOUT_S)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*streams), CALL_TIMEOUT_S)
        assert finished[0] > 0
        # back to the model's own weights: generation is transformers' again
        state = {n: t for n, t in model.state_dict().items() if n in ("model.norm.weight",) or n.endswith("down_proj")}
        await llm.update_weights_from_tensors(list(state.items()), version=version[0] + 1)
        assert await llm.weights_checksum() == hf_checksum(model)
        outs = []
        for i, p in enumerate(prompts):
            async for out in llm.generate(p, PARAMS, f"final-{i}"):
                pass
            outs.append(out)
        compare("qwen3_moe after the sequence", prompts, refs, outs)

    llm = ep_engine(folder, AsyncLLM)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()
