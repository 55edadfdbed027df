"""The engine on a CUDA GPU (skipped cleanly without one): greedy float32 tokens and logprobs
against transformers on the same weights, and sleep really returning device memory.

transformers runs on the CPU as the reference; a token may legitimately differ only where the
reference's top-2 logits are within 1e-4 (GPU and CPU float32 sums round differently), so the
comparison stops at the first such near-tie.
"""
import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import CHATS, chat_token_ids, hf_greedy, load_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EXT = "tests.engine.rl_worker_ext.MemoryProbe"
TIE = 1e-4


@pytest.fixture(scope="module")
def prompts(default_model_path):
    from transformers import AutoTokenizer

    return chat_token_ids(AutoTokenizer.from_pretrained(default_model_path), CHATS[:8])


def test_greedy_float32_on_cuda_matches_transformers(default_model_path, prompts):
    refs = hf_greedy(load_hf(default_model_path), prompts, 32)
    llm = LLM(dtype="float32", device="cuda", kv_cache_memory=512 << 20)
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for i, (out, (tokens, lps, gaps)) in enumerate(zip(outs, refs)):
        got = out.outputs[0]
        n = next((j for j, g in enumerate(gaps) if g < TIE), len(tokens))  # up to the first near-tie
        assert got.token_ids[:n] == tokens[:n], f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(got.logprobs[:n], lps[:n])) < 1e-3, f"prompt {i}"


def test_sleep_returns_device_memory():
    llm = LLM(dtype="bfloat16", device="cuda", kv_cache_memory=2 << 30, worker_extension_cls=EXT)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        before = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
        kv = llm.collective_rpc("fill_kv_cache")[0]
        weights = llm.collective_rpc("weight_bytes")[0]
        awake = llm.collective_rpc("cuda_bytes")[0]
        llm.sleep(1)  # KV freed, weights to host memory
        slept = llm.collective_rpc("cuda_bytes")[0]
        assert awake["used"] - slept["used"] >= 0.9 * (kv + weights), (awake, slept, kv, weights)
        llm.wake_up()
        assert llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids == before
        llm.sleep(2)
        assert llm.collective_rpc("cuda_bytes")[0]["allocated"] < 0.05 * (kv + weights)
        llm.wake_up()
        llm.reload_weights()
        assert llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids == before
    finally:
        llm.shutdown()
