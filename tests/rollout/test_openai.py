"""The official `openai` package against the server: completions, chat, streaming, logprobs, n,
usage; greedy text equals the offline engine's (both float32); /generate over the client
(batch, token ids, n > 1, streaming) agrees with the OpenAI route."""
import pytest
from openai import OpenAI

from engine import LLM, SamplingParams
from tests.rollout.conftest import API_KEY, MAX_MODEL_LEN

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def oai(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(oai) -> str:
    models = oai.models.list().data
    assert len(models) == 1
    return models[0].id


@pytest.fixture(scope="module")
def offline():
    """The offline engine, in this process, with the server's settings (greedy is exact in fp32)."""
    llm = LLM(dtype="float32", multiprocess=False, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


def test_completion_greedy_matches_offline_engine(oai, model, offline):
    resp = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    choice = resp.choices[0]
    assert choice.text == want.outputs[0].text
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == MAX_TOKENS
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == MAX_TOKENS
    assert "".join(lp.tokens) == choice.text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) >= 2 for top in lp.top_logprobs)


def test_chat_greedy_matches_offline_engine(oai, model, offline):
    resp = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=3)
    want = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    msg = resp.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == want.outputs[0].text
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[-1].logprob


def test_streaming_equals_non_streaming(oai, model):
    full = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(oai.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices

    stream = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text == oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].text


def test_n_seed_stop_and_batch(oai, model):
    resp = oai.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=4,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    again = oai.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=4,
                                   temperature=1.0, seed=7)
    assert [c.text for c in resp.choices] == [c.text for c in again.choices]  # seeded: reproducible
    greedy = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    stop = greedy.strip().split()[1]
    cut = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert greedy.startswith(cut.choices[0].text)


def test_generate_route_matches_openai_route(client, oai, model):
    text = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    [out] = client.generate(PROMPT, {"temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 1})
    assert out.text == text
    assert len(out.token_ids) == len(out.logprobs) == len(out.weight_versions) == MAX_TOKENS
    assert len(out.top_logprobs) == MAX_TOKENS and all(len(step) >= 1 for step in out.top_logprobs)
    assert out.finish_reason == "length"
    # token ids in: the same prompt as ids gives the same tokens; a batch keeps the order
    outs = client.generate([out.prompt_token_ids, [1, 2, 3]], {"temperature": 0, "max_tokens": MAX_TOKENS})
    assert outs[0].token_ids == out.token_ids and len(outs) == 2
    # n > 1: a list per prompt
    # (ignore_eos: an unseeded sample may end early on EOS, which is not what this checks)
    [samples] = client.generate([out.prompt_token_ids], {"temperature": 1.0, "max_tokens": 4, "n": 3,
                                                         "ignore_eos": True})
    assert len(samples) == 3 and all(len(s.token_ids) == 4 for s in samples)
    # streaming: the deltas add up to the whole
    deltas = [d for _, ds in client.generate_stream(PROMPT, {"temperature": 0, "max_tokens": MAX_TOKENS})
              for d in ds]
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert "".join(d.text for d in deltas) == text and deltas[-1].finish_reason == "length"


def test_echo_logprobs_score_a_prompt_as_generate_does(oai, model, client):
    """How evaluation harnesses score: echo + logprobs (+ max_tokens 0) returns each prompt
    token's logprob, the same values as /generate's prompt_logprobs; the likelier answer wins."""
    text = "Question: What is the capital of France?\nAnswer: Paris"
    r = oai.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for i in range(1, len(lp.tokens)):  # the actual token is among the top entries
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        assert len(lp.top_logprobs[i]) in (2, 3)
    ref = client.generate(text, {"max_tokens": 1, "prompt_logprobs": 0})[0]
    assert len(ref.prompt_token_ids) == len(lp.tokens) and ref.prompt_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-5)

    def score(answer: str) -> float:
        prefix = "Question: What is the capital of France?\nAnswer:"
        out = oai.completions.create(model=model, prompt=prefix + answer, max_tokens=0, echo=True, logprobs=0)
        lps = out.choices[0].logprobs
        start = next(i for i, off in enumerate(lps.text_offset) if off >= len(prefix))
        return sum(lps.token_logprobs[start:])

    assert score(" Paris") > score(" London")
    # echo with generation: the prompt's entries, then the generated ones
    r = oai.completions.create(model=model, prompt=text, max_tokens=3, echo=True, logprobs=0, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.prompt_token_ids) + 3 and r.choices[0].text.startswith(text)
