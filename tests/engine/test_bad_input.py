"""Bad input is refused with a ValueError subclass that names what was wrong, and the engine
keeps serving afterwards: one shared LLM on the real default model."""
import json
import math
import os
import re

import pytest

import engine
from engine import InvalidRequestError, SamplingParams, UnsupportedModelError
from engine.default_model import default_model_path

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROBE = [1, 504, 3458, 314, 2707, 288]  # a short token-id prompt


@pytest.fixture(scope="module")
def llm():
    llm = engine.LLM(dtype="float32", kv_cache_memory=256 << 20, max_model_len=MAX_MODEL_LEN)
    yield llm
    if hasattr(llm, "shutdown"):
        llm.shutdown()


@pytest.fixture(scope="module")
def baseline(llm):
    out = llm.generate([PROBE, "The capital of France is"], GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in out]
    assert all(len(t) == 4 for t in tokens)
    return tokens[0]


def stat(llm, name):
    s = llm.get_stats()
    return s[name] if isinstance(s, dict) else getattr(s, name)


def still_serves(llm, baseline):
    """After an error: no request left behind or holding blocks, and the same greedy output."""
    assert not llm.output_processor.has_unfinished()
    assert stat(llm, "num_running") == 0 and stat(llm, "num_waiting") == 0
    assert stat(llm, "kv_usage") == 0.0, "KV blocks leaked"
    out = llm.generate(PROBE, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == baseline


def names(err, *words):
    msg = str(err.value)
    for w in words:
        assert re.search(rf"\b{re.escape(w)}\b", msg, re.IGNORECASE), f"{w!r} not named in: {msg}"


# ---- prompts --------------------------------------------------------------------------------
PROMPT_CASES = {
    "empty_text": ("", ("prompt", "empty")),
    "empty_ids": ([[]], ("prompt", "empty")),
    "empty_dict_ids": ({"prompt_token_ids": []}, ("prompt", "empty")),
    "too_long": (list(range(10, 10 + MAX_MODEL_LEN)), ("max_model_len",)),
    "far_too_long": (list(range(10, 10 + 3 * MAX_MODEL_LEN)), ("max_model_len",)),
    "negative_id": ([1, 2, -1, 4], ("token", "vocabulary")),
    "id_past_vocab": ([1, 2, 49152], ("token", "vocabulary")),
    "dict_without_prompt": ({"text": "hi"}, ("prompt",)),
    "float_list": ([1.0, 2.0], ("prompt",)),
    "mixed_list": ([[1, 2, 3], 4.5], ("prompt",)),
    "bool_ids": ([True, False], ("prompt",)),
    "nested_none": ([None], ("prompt",)),
}


@pytest.mark.parametrize("case", list(PROMPT_CASES))
def test_bad_prompt_is_refused(llm, baseline, case):
    prompt, words = PROMPT_CASES[case]
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert isinstance(err.value, ValueError)
    names(err, *words)
    still_serves(llm, baseline)


@pytest.mark.parametrize("prompt", [5, 3.5, None, object()], ids=["int", "float", "none", "object"])
def test_wrong_prompt_type_is_refused(llm, baseline, prompt):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    names(err, "prompt")
    still_serves(llm, baseline)


def test_one_bad_prompt_in_a_batch_runs_nothing(llm, baseline):
    with pytest.raises(InvalidRequestError):
        llm.generate([PROBE, [1, 2, 49152], "fine"], GREEDY, use_tqdm=False)
    still_serves(llm, baseline)


def test_longest_prompt_that_fits_still_works(llm, baseline):
    out = llm.generate([list(range(10, 10 + MAX_MODEL_LEN - 1))], SamplingParams(temperature=0, max_tokens=5),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1  # the context is full after one token
    assert out[0].outputs[0].finish_reason == "length"
    still_serves(llm, baseline)


# ---- sampling parameters --------------------------------------------------------------------
PARAM_CASES = {
    "temperature": dict(temperature=-1),
    "temperature_nan": dict(temperature=math.nan),
    "top_p": dict(top_p=0),
    "top_p_above_one": dict(top_p=1.5),
    "top_k": dict(top_k=-2),
    "min_p": dict(min_p=2),
    "max_tokens": dict(max_tokens=0),
    "n": dict(n=0),
    "logprobs": dict(logprobs=100),
    "prompt_logprobs": dict(prompt_logprobs=-1),
    "min_tokens": dict(min_tokens=10, max_tokens=5),
    "n_greedy": dict(n=2, temperature=0),
    "seed": dict(seed="abc"),
    "stop_token_ids": dict(stop_token_ids=["x"]),
    "logprobs_mode": dict(logprobs_mode="fancy"),
}


@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_nonsense_sampling_values_are_refused(llm, baseline, case):
    kwargs = PARAM_CASES[case]
    field = {"n_greedy": "n"}.get(case, case.split("_above")[0].replace("_nan", ""))
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, ValueError)
    names(err, field)
    still_serves(llm, baseline)


def test_sampling_params_of_the_wrong_type_are_refused(llm, baseline):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(PROBE, {"temperature": 0}, use_tqdm=False)
    names(err, "sampling")
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([PROBE, PROBE], [GREEDY], use_tqdm=False)
    names(err, "prompts")
    still_serves(llm, baseline)


# ---- models ---------------------------------------------------------------------------------
def test_missing_folder_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedModelError) as err:
        engine.LLM(str(tmp_path / "no-such-model"))
    assert isinstance(err.value, ValueError)
    assert "no-such-model" in str(err.value)


def test_folder_without_config_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedModelError) as err:
        engine.LLM(str(tmp_path))
    names(err, "config.json")


def test_unknown_architecture_is_unsupported(tmp_path):
    src = default_model_path()
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    os.symlink(src / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModelError) as err:
        engine.LLM(str(tmp_path), dtype="float32", kv_cache_memory=64 << 20)
    names(err, "GPT2LMHeadModel", "architecture")


def test_folder_without_weights_is_unsupported(tmp_path):
    (tmp_path / "config.json").write_text((default_model_path() / "config.json").read_text())
    with pytest.raises(UnsupportedModelError) as err:
        engine.LLM(str(tmp_path))
    names(err, "safetensors")


def test_after_all_errors_the_engine_still_serves(llm, baseline):
    still_serves(llm, baseline)
    out = llm.generate([PROBE, "The capital of France is"], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == baseline
    assert out[1].outputs[0].text


def test_top_k_larger_than_the_vocabulary_means_no_top_k(llm, baseline):
    """vLLM accepts any top_k >= 0; one past the vocabulary filters nothing. (Kept last: when the
    sampler crashes on it, the engine core dies, and every later test would fail with it.)"""
    params = SamplingParams(temperature=1.0, top_k=10 ** 6, max_tokens=4, seed=0)
    ref = SamplingParams(temperature=1.0, top_k=0, max_tokens=4, seed=0)
    try:
        out = llm.generate([PROBE], params, use_tqdm=False)
    except InvalidRequestError as e:  # refusing it up front is acceptable too
        assert "top_k" in str(e)
    else:
        assert out[0].outputs[0].token_ids == llm.generate([PROBE], ref, use_tqdm=False)[0].outputs[0].token_ids
    still_serves(llm, baseline)
