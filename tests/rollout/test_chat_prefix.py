"""Chat with the earlier turns as token ids (`prefix_token_ids`) over the real server (the session's
float32 default model, SmolLM2's ChatML template): a 3-turn conversation runs on prompts that begin
with exactly the ids given; an altered split of the same text is reported at its offset; a prefix
equal to the template's own ids has no drift (with and without the turn's closing "\\n"); a turn
cut by max_tokens gets the end-of-turn token and the closing appended; greedy answers equal
/generate on the same explicit ids, on /generate and on /v1/chat/completions, streamed or not,
also many at once; bad input is a 400 naming the field. The ending and drift rules as units."""
import json
import threading

import httpx
import pytest

from rollout.api.chat_prefix import drift, turn_closing
from tests.rollout.conftest import API_KEY, MAX_MODEL_LEN

GREEDY = {"temperature": 0, "max_tokens": 6, "logprobs": 0}
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
NL, EOT = 198, 2  # "\n" and <|im_end|> in SmolLM2's vocabulary
USER = {"Authorization": f"Bearer {API_KEY}"}


def turns(*contents):
    """A conversation: system, then user / assistant alternating."""
    return [SYSTEM] + [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]


def test_three_turns_keep_every_prefix_and_match_generate(client):
    convo = turns("What is 2 * 3?")
    out = client.generate_chat(convo, GREEDY)
    rendered = client.tokenize(messages=convo)
    assert out.prompt_token_ids == rendered and out.retokenization_drift is None
    for question in ("And 3 * 4?", "And 4 * 5?"):
        prefix = out.prompt_token_ids + out.token_ids
        convo = convo + [{"role": "assistant", "content": out.text}, {"role": "user", "content": question}]
        before = len(out.prompt_token_ids)
        out = client.generate_chat(convo, GREEDY, prefix_token_ids=prefix)
        assert out.prompt_token_ids[:len(prefix)] == prefix, "the earlier turns were re-tokenized"
        closing = out.closing_token_ids
        assert closing == ([NL] if prefix[-1] == EOT else [EOT, NL])  # the model's turn, closed as the template does
        # what follows the prefix is the template's own ids for the new user message
        tail = client.tokenize(messages=convo)[-(len(out.prompt_token_ids) - len(prefix) - len(closing)):]
        assert out.prompt_token_ids[len(prefix) + len(closing):] == tail
        # where the template would spell the model's answer otherwise, that is reported, never fixed
        d = out.retokenization_drift
        assert d is None or d["offset"] >= before, d
        assert (d is None) == (prefix + closing == client.tokenize(messages=convo[:-1], add_generation_prompt=False))
        again = client.generate(out.prompt_token_ids, GREEDY)[0]
        assert again.token_ids == out.token_ids
        # (float32: a prefix-cache hit computes the same logits in other shapes, ~1e-6 apart)
        assert again.logprobs == pytest.approx(out.logprobs, abs=1e-4)


def test_a_split_of_the_same_text_is_drift_at_its_offset(client):
    convo = turns("What is 2 * 3?", "Six.", "Thanks!")
    rendered = client.tokenize(messages=convo[:3], add_generation_prompt=False)
    what = client.tokenize(prompt="What")
    assert len(what) == 1
    at = rendered.index(what[0])
    split = client.tokenize(prompt="Wh") + client.tokenize(prompt="at")  # the same text, other tokens
    altered = rendered[:at] + split + rendered[at + 1:]
    out = client.generate_chat(convo, GREEDY, prefix_token_ids=altered)
    assert out.prompt_token_ids[:len(altered)] == altered  # run as given
    d = out.retokenization_drift
    assert d["offset"] == at
    assert d["prefix_ids"][at - d["window_start"]:][:2] == split
    assert d["rendered_ids"][at - d["window_start"]] == what[0]
    assert d["rendered_tokens"][at - d["window_start"]] == "What"
    assert out.closing_token_ids == []  # (the prefix already ends with the template's "\n")


def test_no_drift_when_the_prefix_is_the_templates_own(client):
    convo = turns("What is 2 * 3?", "Six.", "Thanks!")
    rendered = client.tokenize(messages=convo[:3], add_generation_prompt=False)
    assert rendered[-2:] == [EOT, NL]
    full = client.tokenize(messages=convo)
    for prefix, closing in ((rendered, []), (rendered[:-1], [NL]), (rendered[:-2], [EOT, NL])):
        out = client.generate_chat(convo, GREEDY, prefix_token_ids=prefix)
        assert out.retokenization_drift is None and out.closing_token_ids == closing
        assert out.prompt_token_ids == full  # the same ids the template gives the whole conversation


def test_a_turn_cut_by_max_tokens_is_closed(client):
    convo = turns("Tell me about dragons.")
    first = client.generate_chat(convo, dict(GREEDY, max_tokens=3))
    assert first.finish_reason == "length" and first.token_ids[-1] != EOT
    convo += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Go on."}]
    out = client.generate_chat(convo, GREEDY, prefix_token_ids=first.prompt_token_ids + first.token_ids)
    assert out.closing_token_ids == [EOT, NL]


def post(server, path, body, stream=False):
    if not stream:
        return httpx.post(server.url + path, json=body, headers=USER, timeout=300)
    with httpx.stream("POST", server.url + path, json=body, headers=USER, timeout=300) as r:
        lines = [ln for ln in r.iter_lines() if ln.strip()]
    return [json.loads(ln.removeprefix("data: ")) for ln in lines if ln != "data: [DONE]"]


def test_chat_completions_and_streams_carry_the_prompt_and_the_drift(server, client):
    convo = turns("What is 2 * 3?", "Six.", "Thanks!")
    rendered = client.tokenize(messages=convo[:3], add_generation_prompt=False)
    at = rendered.index(client.tokenize(prompt="What")[0])
    altered = rendered[:at] + client.tokenize(prompt="Wh") + client.tokenize(prompt="at") + rendered[at + 1:]
    want = client.generate_chat(convo, GREEDY, prefix_token_ids=altered)
    body = {"messages": convo, "prefix_token_ids": altered, "temperature": 0, "max_tokens": 6}
    chat = post(server, "/v1/chat/completions", body).json()
    assert chat["prompt_token_ids"] == want.prompt_token_ids and chat["retokenization_drift"]["offset"] == at
    assert chat["choices"][0]["message"]["content"] == want.text
    chunks = post(server, "/v1/chat/completions", dict(body, stream=True), stream=True)
    assert chunks[0]["prompt_token_ids"] == want.prompt_token_ids and chunks[0]["retokenization_drift"]["offset"] == at
    assert "retokenization_drift" not in chunks[1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want.text
    lines = post(server, "/generate", {"messages": convo, "prefix_token_ids": altered, "stream": True,
                                       "sampling_params": GREEDY}, stream=True)
    assert lines[0]["retokenization_drift"]["offset"] == at and lines[0]["closing_token_ids"] == []
    assert lines[0]["prompt_token_ids"] == want.prompt_token_ids
    assert [t for ln in lines for t in ln["outputs"][0]["token_ids"]] == want.token_ids


def test_many_prefixed_conversations_at_once(client):
    """Concurrent requests with different prefixes: each gets its own prompt and the answer it
    gets alone."""
    convos = [turns(f"What is {i} * 3?", f"It is {3 * i}.", "And times 2?") for i in range(4)]
    prefixes = [client.tokenize(messages=c[:3], add_generation_prompt=False)[:-1] for c in convos]
    alone = [client.generate_chat(c, GREEDY, prefix_token_ids=p) for c, p in zip(convos, prefixes)]
    box = {}

    def run(i):
        box[i] = client.generate_chat(convos[i], GREEDY, prefix_token_ids=prefixes[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i in range(4):
        assert box[i].prompt_token_ids == alone[i].prompt_token_ids and box[i].token_ids == alone[i].token_ids
        assert box[i].prompt_token_ids[:len(prefixes[i])] == prefixes[i]


MSGS = turns("Hi", "Hello", "Bye")


@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"messages": MSGS, "prefix_token_ids": "abc"}, "prefix_token_ids"),
    ("/generate", {"messages": MSGS, "prefix_token_ids": [1, 2.5]}, "prefix_token_ids[1]"),
    ("/generate", {"messages": MSGS, "prefix_token_ids": [1, "a"]}, "prefix_token_ids[1]"),
    ("/generate", {"messages": MSGS, "prefix_token_ids": [1, 49152]}, "prefix_token_ids[1]"),
    ("/generate", {"messages": MSGS, "prefix_token_ids": [1, -3]}, "prefix_token_ids[1]"),
    ("/generate", {"messages": MSGS, "prefix_token_ids": []}, "prefix_token_ids"),
    ("/generate", {"prompt": "Hi", "prefix_token_ids": [1, 2]}, "prefix_token_ids"),
    ("/generate", {"prompt_token_ids": [1, 2], "prefix_token_ids": [1, 2]}, "prefix_token_ids"),
    ("/generate", {"messages": MSGS[:2], "prefix_token_ids": [1, 2]}, "prefix_token_ids"),  # no assistant turn
    ("/generate", {"messages": MSGS, "prefix_token_ids": [1] * MAX_MODEL_LEN}, "prefix_token_ids"),
    ("/generate", {"messages": MSGS, "prefix_token_ids": [1] * (MAX_MODEL_LEN - 3)}, "prefix_token_ids"),  # + new
    ("/generate", {"messages": MSGS, "prefix_token_ids": [1, 2], "session_params": {"id": "s"}}, "prefix_token_ids"),
    ("/v1/chat/completions", {"messages": MSGS, "prefix_token_ids": [1, None]}, "prefix_token_ids[1]"),
    ("/v1/chat/completions", {"messages": MSGS, "prefix_token_ids": [1, 10 ** 6]}, "prefix_token_ids[1]"),
    ("/v1/chat/completions", {"messages": MSGS[:3], "prefix_token_ids": [1, 2], "continue_final_message": True,
                              "add_generation_prompt": False}, "continue_final_message"),
])
def test_bad_prefixes_are_400s_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, headers=USER, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- units ------------------------------------------------------------------------------------------
def test_turn_closing_appends_what_the_prefix_lacks():
    covered = [7, 8, EOT, NL, 9, 10, EOT, NL]  # ... <|im_end|>\n <assistant> ... <|im_end|>\n
    assert turn_closing([9, 10, EOT], covered, 4, {EOT}) == [NL]
    assert turn_closing([9, 10, EOT, NL], covered, 4, {EOT}) == []
    assert turn_closing([9, 10], covered, 4, {EOT}) == [EOT, NL]
    assert turn_closing([9, NL], covered, 4, {EOT}) == [EOT, NL]  # a "\n" of its own is not the closing
    # the ending is looked for in the last turn only: a template that does not close it adds nothing
    assert turn_closing([9, 10], [7, 8, EOT, NL, 9, 10], 4, {EOT}) == []


def test_drift_is_the_first_offset_that_differs():
    assert drift([1, 2, 3], [1, 2, 3]) is None
    assert drift([1, 2, 4, 5], [1, 2, 3, 5]) == {"offset": 2, "window_start": 0, "prefix_ids": [1, 2, 4, 5],
                                                 "rendered_ids": [1, 2, 3, 5]}
    assert drift([1, 2], [1, 2, 3])["offset"] == 2  # the prefix ends early
    assert drift([1, 2, 3, 4], [1, 2, 3])["offset"] == 3  # or runs past the template's turns
    assert drift(list(range(10)), list(range(9)) + [0])["window_start"] == 7
