"""SamplingParams.return_sampling_mask on the real default model (float32), and the temperature-
scaled prompt logprobs a recompute compares with.

The kept sets are checked against a truncation recomputed here from transformers' logits for the
same sequences (teacher-forced), not against the sampler's own code: top-k, top-p and min-p applied
by hand to log-softmax(logits / T) in float32. Float32 engine and transformers logits differ by
~1e-5, so a position whose top-p or min-p verdict lies that close to its cut is skipped, and the
test says how many were (none, normally)."""
import pytest
import torch

from engine import LLM, InvalidRequestError, SamplingParams
from engine.sampling_params import MAX_SAMPLING_MASK_IDS
from tests.engine.hf_reference import CHATS, chat_token_ids, load_hf

MARGIN = 1e-4  # a verdict this close to its cut may go either way between two float32 runs
T = 0.9
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def hf(llm):
    return load_hf(llm.config.model)


@pytest.fixture(scope="module")
def prompts(llm):
    return chat_token_ids(llm.tokenizer, [CHATS[3], CHATS[9]])


def generate(llm, prompts, **kw):
    params = SamplingParams(max_tokens=NUM_TOKENS, seed=11, logprobs=0, ignore_eos=True, **kw)
    return [o.outputs[0] for o in llm.generate([list(p) for p in prompts], params, use_tqdm=False)]


@torch.inference_mode()
def hf_logits(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """(len(completion), V) float32: the logits that predicted each completion token."""
    logits = hf(torch.tensor([prompt + completion])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(completion)]


def reference_kept(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> tuple[list[int], float]:
    """(the kept ids of one row of logits / T, highest first, ties by lower id; the distance of
    the nearest top-p / min-p verdict from its cut)."""
    order = torch.argsort(x, descending=True, stable=True)
    xs = x[order]
    n = len(xs)
    margin = float("inf")
    if top_k:
        n = min(n, top_k)
    if top_p < 1:
        p = xs[:n].softmax(0)
        before = p.cumsum(0) - p
        n = max(int((before < top_p).sum()), 1)
        margin = min(margin, float((before - top_p).abs().min()))
    if min_p > 0:
        p = xs[:n].softmax(0)
        rel = p / p.max()
        n = int((rel >= min_p).sum())  # (a prefix: rel falls along the order)
        margin = min(margin, float((rel - min_p).abs().min()))
    return order[:n].tolist(), margin


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_k=30, top_p=0.95, min_p=0.01),
                                pytest.param(dict(top_p=0.8), marks=pytest.mark.slow),
                                pytest.param(dict(min_p=0.05), marks=pytest.mark.slow)], ids=str)
def test_kept_sets_match_a_truncation_of_transformers_logits(llm, hf, prompts, kw):
    outs = generate(llm, prompts, temperature=T, return_sampling_mask="ids", **kw)
    checked = skipped = 0
    for prompt, out in zip(prompts, outs):
        assert len(out.sampling_masks) == len(out.token_ids) == NUM_TOKENS
        logits = hf_logits(hf, prompt, out.token_ids) / T
        for j, (t, m) in enumerate(zip(out.token_ids, out.sampling_masks)):
            assert t in m.ids, f"the sampled token {t} is outside its kept set"
            if "top_k" in kw and "top_p" not in kw:
                assert m.num_kept == kw["top_k"] == len(m.ids)
            want, margin = reference_kept(logits[j], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
            if margin < MARGIN:
                skipped += 1
                continue
            checked += 1
            assert m.num_kept == len(want)
            assert m.ids == (want if len(want) <= MAX_SAMPLING_MASK_IDS else None), f"token {j}"
            lps = logits[j].log_softmax(0)
            assert m.min_logprob == pytest.approx(float(lps[want].min()), abs=1e-4)
            assert m.kept_logmass == pytest.approx(float(lps[want].logsumexp(0)), abs=1e-4)
            # the processed logprob is renormalised over the set: + kept_logmass = the untruncated one
            assert out.logprobs[j] + m.kept_logmass == pytest.approx(float(lps[t]), abs=1e-4)
    assert skipped <= 2 and checked >= 2 * NUM_TOKENS - 2, (checked, skipped)


def test_greedy_keeps_the_token_drawn(llm, hf, prompts):
    outs = generate(llm, prompts[:1], temperature=0, return_sampling_mask="ids")
    plain = generate(llm, prompts[:1], temperature=0)
    for prompt, out, ref in zip(prompts, outs, plain):
        assert out.token_ids == ref.token_ids  # the mask changes nothing drawn
        lps = hf_logits(hf, prompt, out.token_ids).log_softmax(-1)
        for j, (t, m) in enumerate(zip(out.token_ids, out.sampling_masks)):
            assert (m.num_kept, m.ids) == (1, [t])
            assert m.min_logprob == m.kept_logmass == pytest.approx(float(lps[j, t]), abs=1e-4)


def test_threshold_form_and_no_truncation(llm, prompts):
    """True / "threshold": no ids; without top-k / top-p / min-p the set is the whole vocabulary."""
    full, = generate(llm, prompts[:1], temperature=1.0, return_sampling_mask=True)
    vocab = llm.processor.vocab_size
    assert all(m.num_kept == vocab and m.ids is None and abs(m.kept_logmass) < 1e-5 for m in full.sampling_masks)
    top_p, = generate(llm, prompts[:1], temperature=1.0, top_p=0.8, return_sampling_mask="threshold")
    assert all(m.ids is None and 1 <= m.num_kept < vocab for m in top_p.sampling_masks)
    none, = generate(llm, prompts[:1], temperature=1.0, top_p=0.8)
    assert none.sampling_masks is None and none.token_ids == top_p.token_ids


def test_mixed_batch_and_n(llm, prompts):
    """Rows that ask and rows that do not, n > 1, in one batch: each sample its own sets."""
    params = [SamplingParams(max_tokens=8, seed=3, top_k=4, return_sampling_mask="ids", n=3),
              SamplingParams(max_tokens=8, seed=3, top_k=4)]
    outs = llm.generate([list(prompts[0]), list(prompts[1])], params, use_tqdm=False)
    for c in outs[0].outputs:
        assert [len(m.ids) for m in c.sampling_masks] == [4] * len(c.token_ids)
        assert all(t in m.ids for t, m in zip(c.token_ids, c.sampling_masks))
    assert outs[1].outputs[0].sampling_masks is None


@pytest.mark.parametrize("value, words", [("all", "return_sampling_mask"), (1, "return_sampling_mask"),
                                          (None, "return_sampling_mask")])
def test_bad_values_are_refused(value, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(return_sampling_mask=value, top_k=5)
    assert e.value.param == "return_sampling_mask" and words in str(e.value)


def test_ids_without_a_truncation_are_refused():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(return_sampling_mask="ids", temperature=0.7)
    assert e.value.param == "return_sampling_mask" and "whole vocabulary" in str(e.value)
    SamplingParams(return_sampling_mask="ids", temperature=0)  # greedy: the one token
    assert SamplingParams(return_sampling_mask=True).return_sampling_mask == "threshold"


def test_temperature_scaled_prompt_logprobs_equal_the_sampled_ones(llm, prompts):
    """The recompute /logprobs/compare runs: prompt logprobs of logits / T over prompt + completion
    give the sampled tokens' processed logprobs back (no truncation); raw prompt logprobs do not."""
    out, = generate(llm, prompts[:1], temperature=0.7)
    seq = list(prompts[0]) + out.token_ids
    n = len(prompts[0])
    scaled, raw = (llm.generate([seq], SamplingParams(max_tokens=1, temperature=0.7, prompt_logprobs=0,
                                                      temp_scaled_prompt_logprobs=flag), use_tqdm=False)[0]
                   .prompt_logprobs[n:] for flag in (True, False))
    assert max(abs(a - b) for a, b in zip(scaled, out.logprobs)) < 1e-4
    assert max(abs(a - b) for a, b in zip(raw, out.logprobs)) > 1e-2
