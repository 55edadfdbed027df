"""The engine on a CUDA GPU (skipped cleanly without one), against transformers on the same GPU and
weights: greedy float32 tokens and logprobs, with and without CUDA graphs, every supported family
(tiny random-weight models), prefix-cache hits, chunked prefill and preemption; bf16 logprobs as
close to float32 as transformers' own bf16; sleep really returning device memory, cycle after cycle.

A token may legitimately differ only where the reference's top-2 logits are within TIE (two float32
sums in another order round differently), so token comparisons stop at the first such near-tie.
TF32 stays off (torch's default for float32 matmuls), in both engines.
"""
import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import CHATS, chat_token_ids, hf_greedy, hf_prompt_logprobs, load_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EXT = "tests.engine.rl_worker_ext.MemoryProbe"
TIE = 1e-4
LOGPROB_TOL = 1e-3
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def prompts(default_model_path):
    from transformers import AutoTokenizer

    return chat_token_ids(AutoTokenizer.from_pretrained(default_model_path), CHATS[:11])


@pytest.fixture(scope="module")
def hf_cuda(default_model_path):
    model = load_hf(default_model_path).to("cuda")
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def refs(hf_cuda, prompts):
    return hf_greedy(hf_cuda, prompts, GREEDY.max_tokens)


def assert_matches(outs, refs, what=""):
    """Greedy tokens equal up to the reference's first near-tie; logprobs within LOGPROB_TOL there."""
    for i, (out, (tokens, lps, gaps)) in enumerate(zip(outs, refs)):
        got = out.outputs[0]
        n = next((j for j, g in enumerate(gaps) if g < TIE), len(tokens))
        assert n >= len(tokens) // 2, f"{what} prompt {i}: a near-tie at token {n} leaves too little compared"
        assert got.token_ids[:n] == tokens[:n], f"{what} prompt {i}"
        assert max(abs(a - b) for a, b in zip(got.logprobs[:n], lps[:n])) < LOGPROB_TOL, f"{what} prompt {i}"


def graph_sizes(llm) -> set[int]:
    graphs = llm.client.core.executor.worker.model_runner.cuda_graphs
    return set(graphs.graphs) if graphs is not None else set()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_float32_on_cuda_matches_transformers(prompts, refs, enforce_eager):
    """11 prompts decode as one padded batch of 16 (and alone: 1); graphs replay both sizes."""
    llm = LLM(dtype="float32", device="cuda", kv_cache_memory=512 << 20, enforce_eager=enforce_eager,
              multiprocess=False)
    try:
        assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "batch")
        assert_matches(llm.generate(prompts[:1], GREEDY, use_tqdm=False), refs[:1], "alone")
        assert_matches(llm.generate(prompts[:3], GREEDY, use_tqdm=False), refs[:3], "three")
        sizes = graph_sizes(llm)
        assert not sizes if enforce_eager else {1, 4, 16} <= sizes, sizes
    finally:
        llm.shutdown()


def test_async_scheduling_on_cuda_matches_transformers(prompts, refs):
    """Step N+1 scheduled while step N runs on the GPU (its decodes take N's samples on the device,
    through the CUDA graphs): the same tokens as transformers, in a batch and alone."""
    llm = LLM(dtype="float32", device="cuda", kv_cache_memory=512 << 20, async_scheduling=True, multiprocess=False)
    try:
        assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "async batch")
        assert_matches(llm.generate(prompts[:1], GREEDY, use_tqdm=False), refs[:1], "async alone")
        assert {1, 16} <= graph_sizes(llm)
    finally:
        llm.shutdown()


def test_cuda_graphs_follow_a_weight_update_in_place(prompts, refs, default_model_path):
    """A push copies into the tensors the graphs read: the next steps decode with the new weights
    (a zeroed-then-restored update gives the reference again, a scaled one something else)."""
    from safetensors.torch import load_file

    weights = load_file(f"{default_model_path}/model.safetensors")
    llm = LLM(dtype="float32", device="cuda", kv_cache_memory=256 << 20, multiprocess=False)
    try:
        assert_matches(llm.generate(prompts[:3], GREEDY, use_tqdm=False), refs[:3], "before")
        name = next(n for n in weights if n.endswith("layers.0.mlp.down_proj.weight"))
        llm.update_weights_from_tensors([(name, weights[name] * 3)], version=1)
        changed = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in changed] != [r[0] for r in refs[:3]]
        llm.update_weights_from_tensors([(name, weights[name])], version=2)
        assert_matches(llm.generate(prompts[:3], GREEDY, use_tqdm=False), refs[:3], "restored")
        assert 4 in graph_sizes(llm)
    finally:
        llm.shutdown()


def test_chunked_prefill_prefix_hits_and_preemption_on_cuda(prompts, refs):
    """A 16-token step budget (every prompt in chunks), a KV cache of 24 blocks for 11 sequences of
    up to ~100 tokens (preemptions, recomputes), then the same prompts again from the prefix cache."""
    llm = LLM(dtype="float32", device="cuda", kv_cache_memory=24 * 16 * 30 * 2 * 3 * 64 * 4,
              max_num_batched_tokens=16, max_num_seqs=8, multiprocess=False)
    try:
        assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "chunked, preempted")
        assert llm.get_stats()["num_preemptions"] > 0
        again = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens > 0 for o in again)
        assert_matches(again, refs[:2], "prefix hit")
    finally:
        llm.shutdown()


def test_bfloat16_logprobs_are_as_close_to_float32_as_transformers_bfloat16(prompts, hf_cuda, default_model_path):
    """Each of the engine's greedy bf16 tokens scored teacher-forced by transformers on the GPU in
    float32 and in bf16: the engine's distance from float32 is of the size of transformers' own."""
    llm = LLM(dtype="bfloat16", device="cuda", kv_cache_memory=256 << 20, enable_prefix_caching=False,
              multiprocess=False)
    try:
        outs = llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    hf_bf16 = load_hf(default_model_path, torch.bfloat16).to("cuda")
    ours, theirs = [], []
    for ids, out in zip(prompts, outs):
        full = ids + out.outputs[0].token_ids
        ref = hf_prompt_logprobs(hf_cuda, full)[len(ids) - 1:]
        bf16 = hf_prompt_logprobs(hf_bf16, full)[len(ids) - 1:]
        ours += [abs(a - b) for a, b in zip(out.outputs[0].logprobs, ref)]
        theirs += [abs(a - b) for a, b in zip(bf16, ref)]
    mean_ours, mean_theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
    print(f"bf16 vs float32 logprobs, mean / max nats: ours {mean_ours:.4f} / {max(ours):.4f}, "
          f"transformers {mean_theirs:.4f} / {max(theirs):.4f}")
    assert mean_ours < 2 * mean_theirs + 1e-3, (mean_ours, mean_theirs)
    assert max(ours) < max(0.5, 2 * max(theirs)), (max(ours), max(theirs))


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama3", "mistral", "qwen3_moe", "mixtral"])
def tiny_family(request, tmp_path_factory):
    from tests.engine.test_tiny_models import build_model, hf_greedy as tiny_greedy, make_prompts

    folder = tmp_path_factory.mktemp(request.param)
    model = build_model(request.param, folder).to("cuda")
    prompts = make_prompts()
    return request.param, folder, prompts, [tiny_greedy(model, p) for p in prompts]


def test_every_family_on_cuda_matches_transformers(tiny_family, default_model_path):
    """The tiny random-weight families (tests/engine/test_tiny_models.py) with transformers on the
    GPU as reference: Triton attention (sliding window too), norms, rotary with q/k norms, the
    fused experts, chunked prefill where the family's budget is small, the shared prefix's hit."""
    from tests.engine.test_tiny_models import MAX_TOKENS, MODELS

    name, folder, prompts, refs = tiny_family
    llm = LLM(str(folder), dtype="float32", device="cuda", kv_cache_memory=64 << 20,
              tokenizer=str(default_model_path), multiprocess=False, **MODELS[name][2])
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    for i, (out, (tokens, logits)) in enumerate(zip(outs, refs)):
        top2 = logits.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        lps = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
        assert_matches([out], [(tokens, lps, gaps)], f"{name}")
    assert outs[4].num_cached_tokens == 32 or outs[3].num_cached_tokens == 32


def test_sleep_returns_device_memory_cycle_after_cycle():
    """Level 1 returns >= 90% of weights + KV cache to the driver and wakes to the same tokens;
    20 cycles leave the driver's count flat; level 2 frees the weights too."""
    llm = LLM(dtype="bfloat16", device="cuda", kv_cache_memory=2 << 30, worker_extension_cls=EXT)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        before = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
        kv = llm.collective_rpc("fill_kv_cache")[0]
        weights = llm.collective_rpc("weight_bytes")[0]
        awake = llm.collective_rpc("cuda_bytes")[0]
        own = "process" if awake["process"] is not None else "used"  # the engine's own bytes where NVML tells
        used_awake, used_asleep = [], []
        for _ in range(20):
            llm.sleep(1)  # KV freed, weights to host memory
            used_asleep.append(llm.collective_rpc("cuda_bytes")[0][own])
            llm.wake_up()
            assert llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids == before
            used_awake.append(llm.collective_rpc("cuda_bytes")[0][own])
        print(f"sleep ({own}): awake {awake[own] / 2**20:.0f} MiB, asleep {used_asleep[0] / 2**20:.0f} MiB "
              f"(weights {weights / 2**20:.0f} MiB + KV {kv / 2**20:.0f} MiB); over 20 cycles asleep "
              f"{min(used_asleep) / 2**20:.0f}-{max(used_asleep) / 2**20:.0f} MiB, awake "
              f"{min(used_awake) / 2**20:.0f}-{max(used_awake) / 2**20:.0f} MiB")
        assert awake[own] - used_asleep[0] >= 0.9 * (kv + weights), (awake, used_asleep[0], kv, weights)
        assert max(used_asleep) - min(used_asleep) < 64 << 20, used_asleep
        assert max(used_awake) - min(used_awake) < 64 << 20, used_awake
        llm.sleep(2)
        assert llm.collective_rpc("cuda_bytes")[0]["allocated"] < 0.05 * (kv + weights)
        llm.wake_up()
        llm.reload_weights()
        assert llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids == before
    finally:
        llm.shutdown()


def test_seeded_sampling_on_cuda(prompts):
    """A request's seed drives its own host generator: the GPU sampler takes its draws, and the same
    seed gives the same tokens again, next to unseeded rows."""
    llm = LLM(dtype="float32", device="cuda", kv_cache_memory=256 << 20, multiprocess=False)
    try:
        seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=123)
        free = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True)
        first = llm.generate(prompts[:3], [seeded, free, seeded], use_tqdm=False)
        again = llm.generate(prompts[:3], [seeded, free, seeded], use_tqdm=False)
        for i in (0, 2):
            assert first[i].outputs[0].token_ids == again[i].outputs[0].token_ids
    finally:
        llm.shutdown()
