"""Routed experts (routing replay, engine/routed_experts.py) on a tiny random Qwen3-MoE (3 layers, the
middle one dense; 8 experts, top 2), in float32, against transformers' own router choices.

The reference runs the transformers model once over prompt + output (the last token excluded: it
never runs through the model) with output_router_logits and takes each MoE layer's top 2 of the
router's softmax, as kernels.moe.route does. Float32 engine and transformers router logits differ
by ~1e-6: a token whose 2nd and 3rd expert are that close could go either way, so a mismatch is
accepted only where transformers' own gap is below NEAR_TIE (none, normally: the test says).
"""
import numpy as np
import pytest
import torch

import engine
from engine import InvalidRequestError, SamplingParams
from engine.default_model import default_model_path
from engine.frontend.output_processor import OutputProcessor
from engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine.sampling_params import RequestOutputKind
from tests.engine.test_tiny_models import INPROC, VOCAB, build_model

MOE_LAYERS, DENSE_LAYERS, TOP_K = (0, 2), (1,), 2
NEAR_TIE = 1e-4
BLOCK = 16


def engine_args(**kw) -> dict:
    return dict(dtype="float32", kv_cache_memory=16 << 20, block_size=BLOCK, tokenizer=str(default_model_path()),
                **INPROC, **kw)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast, and immune to a busy second core
    folder = tmp_path_factory.mktemp("qwen3_moe_routing")
    model = build_model("qwen3_moe", folder)
    # a 24-token budget: every prompt past 24 tokens is prefilled in chunks
    llm = engine.LLM(str(folder), **engine_args(enable_return_routed_experts=True, max_num_batched_tokens=24))
    yield folder, model, llm
    llm.shutdown()
    torch.set_num_threads(threads)


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_routing(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' choices for every token of `ids`: ((T, num_layers, k) ids, sorted, -1 in dense
    layers; (T, num_layers) the gap between the k-th and (k+1)-th router probability)."""
    logits = model(torch.tensor([ids]), output_router_logits=True).router_logits  # one (T, E) per MoE layer
    routed = np.full((len(ids), 3, TOP_K), -1, dtype=np.int16)
    gaps = np.full((len(ids), 3), np.inf)
    for layer, lg in zip(MOE_LAYERS, logits):
        probs = lg.float().softmax(-1)
        top = probs.topk(TOP_K + 1, dim=-1)
        routed[:, layer] = top.indices[:, :TOP_K].sort(-1).values.numpy()
        gaps[:, layer] = (top.values[:, TOP_K - 1] - top.values[:, TOP_K]).numpy()
    return routed, gaps


def assert_matches_hf(model, prompt: list[int], c) -> None:
    assert c.routed_experts is not None and not c.routed_experts.flags.writeable
    assert_rows_match_hf(model, prompt + c.token_ids, c.routed_experts)


def assert_rows_match_hf(model, ids: list[int], ours: np.ndarray, start: int = 0) -> None:
    """`ours`: the rows of every token of `ids` but the last, from position `start` on."""
    n = len(ids) - 1
    assert isinstance(ours, np.ndarray) and ours.dtype == np.int16 and ours.shape == (n - start, 3, TOP_K), (
        None if ours is None else (ours.shape, ours.dtype), n - start)
    assert (ours[:, DENSE_LAYERS] == -1).all()
    ref, gaps = hf_routing(model, ids[:n])
    ref, gaps = ref[start:], gaps[start:]
    differ = (np.sort(ours, axis=-1) != ref).any(-1)  # (T, num_layers)
    bad = differ & (gaps >= NEAR_TIE)
    assert not bad.any(), (f"routing differs from transformers at (position, layer) {np.argwhere(bad)[:5].tolist()} "
                           f"with gaps {gaps[bad][:5]}")
    assert differ.sum() <= 1, f"{int(differ.sum())} near-tie flips: suspicious"


def sample(llm, prompts, **kw):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, return_routed_experts=True, **kw)
    return llm.generate(prompts, params, use_tqdm=False)


def test_rows_match_transformers_through_chunked_prefill(moe):
    """Prompt and output rows of requests batched together, one prefilled in two chunks."""
    _, model, llm = moe
    prompts = [random_prompt(40, 1), random_prompt(7, 2), random_prompt(23, 3)]
    outs = sample(llm, prompts)
    for p, out in zip(prompts, outs):
        assert_matches_hf(model, p, out.outputs[0])
    plain = llm.generate(prompts[1:2], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs[0].routed_experts is None  # only a request that asks


def test_prefix_cache_hit_returns_the_rows_of_the_request_that_computed_them(moe):
    _, model, llm = moe
    llm.reset_prefix_cache()
    first = random_prompt(40, 4)
    second = first[:32] + random_prompt(6, 5)
    sample(llm, [first])
    out = sample(llm, [second])[0]
    assert out.num_cached_tokens == 32  # two full blocks from the cache: their rows come from the buffer
    assert_matches_hf(model, second, out.outputs[0])


def test_n_samples_each_get_prompt_and_own_output_rows(moe):
    _, model, llm = moe
    prompt = random_prompt(20, 6)
    out = sample(llm, [prompt], n=2)[0]
    a, b = out.outputs
    assert a.token_ids != b.token_ids
    for c in (a, b):
        assert_matches_hf(model, prompt, c)
    assert np.array_equal(a.routed_experts[:len(prompt)], b.routed_experts[:len(prompt)])


def test_preempted_requests_are_recomputed_and_still_match(moe):
    """A cache of 8 blocks for three 70-token sequences: requests are preempted, recomputed, and
    send their recomputed rows again; every row still matches transformers."""
    folder, model, _ = moe
    per_block = 3 * 2 * 2 * 16 * 4 * BLOCK  # layers x (k, v) x kv heads x head_dim x float32 x tokens
    llm = engine.LLM(str(folder), **dict(engine_args(enable_return_routed_experts=True), kv_cache_memory=8 * per_block,
                                         max_model_len=128))
    try:
        prompts = [random_prompt(30, 10 + i) for i in range(3)]
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True,
                                                    return_routed_experts=True), use_tqdm=False)
        assert llm.get_stats()["num_preemptions"] > 0
        for p, out in zip(prompts, outs):
            assert_matches_hf(model, p, out.outputs[0])
    finally:
        llm.shutdown()


def test_sleep_frees_the_routing_buffer_and_wake_up_brings_it_back(moe):
    _, model, llm = moe
    runner = llm.client.core.executor.worker.model_runner
    assert runner.routing is not None and runner.routing.shape == (runner.num_blocks * BLOCK, 3, TOP_K)
    llm.sleep(1)
    assert runner.routing is None and runner.model.routing is None
    llm.wake_up()
    assert runner.routing is not None and (runner.routing == -1).all()  # nothing stale survives
    prompt = random_prompt(18, 20)
    assert_matches_hf(model, prompt, sample(llm, [prompt])[0].outputs[0])


def test_refused_without_the_engine_flag_before_any_work(moe):
    folder, _, _ = moe
    llm = engine.LLM(str(folder), **engine_args())
    try:
        with pytest.raises(InvalidRequestError) as e:
            sample(llm, [[1, 2, 3]])
        assert e.value.param == "return_routed_experts" and "enable_return_routed_experts" in str(e.value)
        core = llm.client.core
        with pytest.raises(InvalidRequestError) as e:  # the engine core's own check (any frontend)
            core.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(return_routed_experts=True)))
        assert e.value.param == "return_routed_experts"
        assert not core.scheduler.requests and llm.get_stats()["num_prefill_tokens"] == 0
    finally:
        llm.shutdown()


def test_refused_on_a_dense_model(tiny_folder):
    with pytest.raises(ValueError, match="enable_return_routed_experts needs a mixture-of-experts model"):
        engine.LLM(tiny_folder, **engine_args(enable_return_routed_experts=True))
    llm = engine.LLM(tiny_folder, **engine_args())
    try:
        with pytest.raises(InvalidRequestError) as e:
            sample(llm, [[1, 2, 3]])
        assert e.value.param == "return_routed_experts" and "dense" in str(e.value)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_sampling_params_field_is_a_bool(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(return_routed_experts=bad)
    assert e.value.param == "return_routed_experts"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(return_routed_experts=True, pooling="last", max_tokens=1)
    assert e.value.param == "return_routed_experts"


# ---- the frontend's assembly (engine/frontend/output_processor.py), on hand-made core outputs ----------
def rows(first: int, n: int, value: int) -> tuple[int, bytes]:
    return first, np.full((n, 3, TOP_K), value, dtype="<i2").tobytes()


def feed(op: OutputProcessor, token: int, piece, finished: bool = False):
    out = EngineCoreOutput("r", [token], routed_experts=piece,
                           finish_reason=FinishReason.LENGTH if finished else None)
    [(_, ro)], _ = op.process_outputs([out])
    return ro.outputs[0].routed_experts


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_output_processor_places_rows_by_position(kind):
    """A 5-token prompt, then tokens; a recompute (after a preemption) sends rows 2..6 again with
    new values: cumulative outputs show them, arrays handed out earlier stay as they were, and a
    delta stream sends only rows it had not sent."""
    op = OutputProcessor(None, routing_shape=(3, TOP_K))
    params = SamplingParams(detokenize=False, return_routed_experts=True, output_kind=kind)
    op.add_request("r", None, [1, 2, 3, 4, 5], params, ["r"])
    first = feed(op, 10, rows(0, 5, 1))  # the prompt's rows with the first token
    assert first.shape == (5, 3, TOP_K) and (first == 1).all()
    second = feed(op, 11, rows(5, 1, 2))
    kept = second.copy()
    third = feed(op, 12, rows(2, 5, 3))  # recomputed positions 2..6 (6 is new)
    fourth = feed(op, 13, rows(7, 1, 4), finished=True)
    if kind == RequestOutputKind.CUMULATIVE:
        assert np.array_equal(second, kept) and second.shape == (6, 3, TOP_K)  # untouched by the recompute
        assert [int(r[0, 0]) for r in third] == [1, 1, 3, 3, 3, 3, 3]
        assert [int(r[0, 0]) for r in fourth] == [1, 1, 3, 3, 3, 3, 3, 4]
    else:
        assert [int(r[0, 0]) for r in second] == [2]
        assert [int(r[0, 0]) for r in third] == [3]  # position 6 only
        assert [int(r[0, 0]) for r in fourth] == [4]
        assert all(not a.flags.writeable for a in (first, second, third, fourth))
