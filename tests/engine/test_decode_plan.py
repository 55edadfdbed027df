"""The C++ decode layer loop (engine/model/decoder.py's DecodePlan, kernels/csrc/decode_layers.cpp)
against the op-by-op Python loop it replaces (enforce_eager), on one engine: greedy tokens and
logprobs bit for bit, in bfloat16 and float32, over float and int8 KV caches, on tiny random
models with each variation the plan carries (Qwen2's q/k/v biases, Qwen3's q/k norms, Mistral's
sliding window), and again after what must make a fresh plan: a weight push, a partial one, a
sleep and wake (which must not leave the freed KV cache and packed weights alive in an old plan).
test_tiny_models.py and test_llm_vs_hf.py hold the plan to transformers."""
import contextlib

import pytest
import torch

import engine
from engine.default_model import default_model_path
from tests.engine.test_tiny_models import build_model, make_prompts

from kernels import cpu_ext

pytestmark = pytest.mark.skipif(cpu_ext.load() is None, reason="the C++ CPU kernels did not build here")

PARAMS = engine.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@contextlib.contextmanager
def tiny_llm(folder, **config):
    llm = engine.LLM(str(folder), kv_cache_memory=64 << 20, block_size=16, tokenizer=str(default_model_path()),
                     multiprocess=False, enable_prefix_caching=False, **config)
    try:
        yield llm
    finally:
        llm.shutdown()


def model_of(llm):
    return llm.client.core.executor.worker.model


def run(llm, prompts, plan: bool):
    """(token ids, logprobs) of each prompt, the decode steps' layers through the plan or op by op."""
    model = model_of(llm)
    model.use_decode_plan = plan
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    if plan:
        assert model._plan is not None, "the plan was not made: this test compares nothing"
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outs]


def same_both_ways(llm, prompts):
    eager = run(llm, prompts, plan=False)
    planned = run(llm, prompts, plan=True)
    assert planned == eager
    return planned


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name in ("qwen2", "qwen3", "mistral"):
        out[name] = tmp_path_factory.mktemp(name)
        build_model(name, out[name])
    return out


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")])
def test_plan_matches_the_python_loop(folders, name, dtype, kv):
    with tiny_llm(folders[name], dtype=dtype, kv_cache_dtype=kv) as llm:
        prompts = make_prompts()
        same_both_ways(llm, prompts)  # five sequences a step, the longest past Mistral's window
        same_both_ways(llm, prompts[:1])


def test_plan_follows_pushes_and_sleep(folders):
    with tiny_llm(folders["qwen3"], dtype="bfloat16") as llm:
        prompts = make_prompts()
        before = same_both_ways(llm, prompts)
        plan = model_of(llm)._plan
        # every tensor pushed (the spare swapped in whole), then layer 0's alone (copied in)
        g = torch.Generator().manual_seed(5)
        named = [(n, (v.float() * (1 + 0.2 * torch.randn(v.shape, generator=g))).to(v.dtype))
                 for n, v in model_of(llm).hf_views()]
        llm.update_weights_from_tensors(named)
        pushed = same_both_ways(llm, prompts)
        assert pushed != before, "the push changed nothing: the test could not see a stale plan"
        assert model_of(llm)._plan is not plan
        layer_only = [(n, t.flip(0)) for n, t in named if ".layers.0." in n]
        llm.update_weights_from_tensors(layer_only)
        partial = same_both_ways(llm, prompts)
        assert partial != pushed
        assert llm.sleep(level=1)
        assert model_of(llm)._plan is None, "a plan kept through sleep holds the freed KV cache and packed weights"
        llm.wake_up()
        assert same_both_ways(llm, prompts) == partial


def test_no_plan_for_a_mixture_of_experts(tmp_path):
    build_model("qwen3_moe", tmp_path)
    with tiny_llm(tmp_path, dtype="float32") as llm:
        llm.generate(make_prompts()[:2], PARAMS, use_tqdm=False)
        model = model_of(llm)
        assert model.use_decode_plan and model._plan_kv is not None and model._plan is None


def test_enforce_eager_keeps_the_python_loop(folders):
    with tiny_llm(folders["qwen2"], dtype="float32", enforce_eager=True) as llm:
        llm.generate(make_prompts()[:2], PARAMS, use_tqdm=False)
        assert not model_of(llm).use_decode_plan and model_of(llm)._plan is None
