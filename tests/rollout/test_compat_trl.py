"""TRL against a real `rollout serve`, with TRL's own client code where it installs.

TRL 1.16.0 (the newest release, from PyPI; its client is trl/generation/vllm_client.py,
`VLLMClient`) talks to vLLM's own routes: /health, /v1/models, /v1/completions (texts or token
ids, return_token_ids, return_tokens_as_token_ids, n choices prompt-major, logprobs; and
prompt_logprobs for its distillation call get_sequence_logprobs), /v1/chat/completions (one
conversation per request; the prompt's ids at the top level; tools with tool_choice "none"),
/get_world_size, /server_info?config_format=json and /reset_prefix_cache. Here the real
VLLMClient runs against a `rollout serve` subprocess of a tiny random Llama (float32, the default
model's tokenizer and chat template plus a line that renders tools), and what it returns is
checked against transformers on the same folder: greedy tokens equal, logprobs within 1e-4 nats
(two correct float32 implementations differ by ~1e-6; the tiny model's top-2 logits differ by
~1e-3 or more).

How TRL's "is vllm installed" check is met: VLLMClient refuses to start unless
`importlib.util.find_spec("vllm")` finds a package with a version (trl/import_utils.py
is_vllm_available), and trl.generation imports a few vllm names at import time. The real vllm
wheel pulls CUDA, so tests/rollout/vllm_stub holds a stub `vllm` (version 0.28.0, which selects
TRL's current code paths; the names TRL imports, each raising if called), and the client runs in
a subprocess (tests/rollout/trl_client_proc.py) with that folder on its PYTHONPATH only: no
other test, and not this process, sees a `vllm` package.

TRL 1.10 and older used `trl vllm-serve`'s own routes (trailing slashes; rollout/compat/trl.py).
TRL 1.10.0's client cannot run next to 1.16.0, so those routes get contract tests with httpx that
send exactly what trl@1.10.0:trl/generation/vllm_client.py sends (bodies field for field) and
read the answers as that file and trl@1.10.0:trl/scripts/vllm_serve.py define them.
"""
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rollout.subprocess_server import served
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.rollout.conftest import REPO_ROOT, tiny_model_folder

STUB = Path(__file__).parent / "vllm_stub"
TOL = 1e-4  # nats: float32 engine vs float32 transformers
PROMPTS = ["The capital of France is", "Write a haiku about the sea."]
ID_PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 665, 28, 940]]
CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a color."}]]
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
MAX_TOKENS = 6
# what the client is asked, by name: [name, VLLMClient method, its keyword arguments]
CALLS = [
    ["greedy", "generate", {"prompts": PROMPTS, "temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 2}],
    ["sampled", "generate", {"prompts": ID_PROMPTS, "n": 2, "temperature": 1.0, "max_tokens": MAX_TOKENS,
                             "generation_kwargs": {"seed": 7}}],
    ["no_logprobs", "generate", {"prompts": PROMPTS[:1], "max_tokens": 2, "logprobs": None}],
    ["regex", "generate", {"prompts": PROMPTS[:1], "structured_outputs_regex": "[0-9]+"}],
    ["chat_greedy", "chat", {"messages": CHATS, "temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 1}],
    ["chat_sampled", "chat", {"messages": CHATS, "n": 2, "max_tokens": MAX_TOKENS}],
    ["chat_tools", "chat", {"messages": CHATS[:1], "temperature": 0.0, "max_tokens": 2, "tools": [TOOL]}],
    ["world_size", "get_world_size", {}],
    ["server_info", "get_server_info", {}],
    ["scored", "get_sequence_logprobs", {"sequences": [ID_PROMPTS[0] + [7, 8, 9], ID_PROMPTS[1] + [10, 11]],
                                         "prompt_lengths": [5, 4], "top_logprobs": 5}],
    ["scored_chunked", "get_sequence_logprobs", {"sequences": [ID_PROMPTS[0] + [7, 8, 9], ID_PROMPTS[1] + [10, 11]],
                                                 "prompt_lengths": [5, 4], "top_logprobs": 5, "chunk_size": 1}],
    ["scored_top100", "get_sequence_logprobs", {"sequences": [ID_PROMPTS[0]], "prompt_lengths": [2]}],
    ["reset", "reset_prefix_cache", {}],
    ["init_communicator", "init_communicator", {"device": "cpu"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_model_path) -> str:
    path = tmp_path_factory.mktemp("trl_tiny")
    tiny_model_folder(path, default_model_path)
    template = (Path(default_model_path) / "chat_template.jinja").read_text()  # (it ignores tools: show them)
    (path / "chat_template.jinja").write_text("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}" + template)
    return str(path)


@pytest.fixture(scope="module")
def url(folder, tmp_path_factory):
    with served(folder, "--dtype", "float32", log_path=tmp_path_factory.mktemp("logs") / "serve.log",
                cwd=REPO_ROOT) as server:  # no API key: TRL's client sends none
        yield server.url


@pytest.fixture(scope="module")
def trl(url) -> dict:
    """TRL 1.16.0's VLLMClient, run once over CALLS in a subprocess with the vllm stub."""
    env = dict(os.environ, PYTHONPATH=str(STUB), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "trl_client_proc.py")],
                          input=json.dumps({"url": url, "calls": CALLS}), capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["versions"]["trl"] == "1.16.0" and out["versions"]["vllm_available"], out["versions"]
    assert out["versions"]["vllm_stub"].startswith(str(STUB)), out["versions"]
    return out["results"]


@pytest.fixture(scope="module")
def hf(folder):
    return load_hf(folder)


@pytest.fixture(scope="module")
def tok(folder):
    return AutoTokenizer.from_pretrained(folder)


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float32: row i is the log-softmax predicting token i + 1."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def chat_ids(tok, convo, **kwargs) -> list[int]:
    return tok.encode(tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False, **kwargs),
                      add_special_tokens=False)


def check_generated(hf, prompt_ids, completion_ids, logprobs, token_ids):
    """Each sampled token's logprob (the best-first entry that is that token) equals transformers'
    teacher-forced logprob, and every top entry equals transformers' logprob of that id."""
    rows = hf_logprobs(hf, prompt_ids + completion_ids)[len(prompt_ids) - 1:]
    for pos, t in enumerate(completion_ids):
        assert t in token_ids[pos]
        for tid, lp in zip(token_ids[pos], logprobs[pos]):
            assert abs(lp - rows[pos, tid].item()) < TOL, (pos, tid, lp, rows[pos, tid].item())
        assert logprobs[pos] == sorted(logprobs[pos], reverse=True)


# ---- TRL 1.16.0's VLLMClient ---------------------------------------------------------------------
def test_generate_text_prompts_greedy_equals_transformers(trl, hf, tok):
    """VLLMClient.generate: POST /v1/completions with texts; prompt_ids from choices[::n]."""
    out = trl["greedy"]
    assert out["prompt_ids"] == [tok.encode(p) for p in PROMPTS]
    want = hf_greedy(hf, out["prompt_ids"], MAX_TOKENS)
    assert out["completion_ids"] == [w[0] for w in want], [w[2] for w in want]  # (top-2 gaps if not)
    for p, c, lps, ids in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        check_generated(hf, p, c, lps, ids)
        assert all(len(step) == 2 and step[0] == t for step, t in zip(ids, c))  # top-2, greedy token first


def test_generate_token_ids_n2_prompt_major(trl, hf):
    """n=2 over two token-id prompts: four completions, prompt 0's two first (TRL reads
    choices[::n] as the prompts); each token's logprob is transformers' under *its* prompt."""
    out = trl["sampled"]
    assert out["prompt_ids"] == ID_PROMPTS
    assert len(out["completion_ids"]) == 4 and all(len(c) == MAX_TOKENS for c in out["completion_ids"])
    for i, (c, lps, ids) in enumerate(zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"])):
        check_generated(hf, ID_PROMPTS[i // 2], c, lps, ids)
        assert [step[0] for step in ids] == c  # logprobs=0: the sampled token alone
    assert trl["no_logprobs"]["logprobs"] is None and trl["no_logprobs"]["logprob_token_ids"] is None


def test_chat_greedy_equals_transformers(trl, hf, tok):
    """VLLMClient.chat: one POST /v1/chat/completions per conversation; prompt_ids from the
    top-level prompt_token_ids, logprobs from content[].token "token_id:<id>"."""
    out = trl["chat_greedy"]
    assert out["prompt_ids"] == [chat_ids(tok, c) for c in CHATS]
    assert out["completion_ids"] == [w[0] for w in hf_greedy(hf, out["prompt_ids"], MAX_TOKENS)]
    for p, c, lps, ids in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        check_generated(hf, p, c, lps, ids)
    sampled = trl["chat_sampled"]
    assert sampled["prompt_ids"] == out["prompt_ids"] and len(sampled["completion_ids"]) == 4
    for i, (c, lps, ids) in enumerate(zip(sampled["completion_ids"], sampled["logprobs"],
                                          sampled["logprob_token_ids"])):
        check_generated(hf, out["prompt_ids"][i // 2], c, lps, ids)


def test_chat_with_tools_renders_them(trl, tok):
    """tools + tool_choice "none" (what TRL sends): the tools are rendered into the prompt."""
    out = trl["chat_tools"]
    assert "error" not in out, out
    assert out["prompt_ids"] == [chat_ids(tok, CHATS[0], tools=[TOOL])] != [chat_ids(tok, CHATS[0])]


def test_get_sequence_logprobs_equals_transformers(trl, hf):
    """VLLMClient.get_sequence_logprobs (the teacher-scoring call): POST /v1/completions with
    prompt_logprobs; it sorts each position's entries by `rank` and reads the actual token's."""
    for name in ("scored", "scored_chunked"):
        out = trl[name]
        for seq, start, lps, ids, actual, actual_ids in zip([ID_PROMPTS[0] + [7, 8, 9], ID_PROMPTS[1] + [10, 11]],
                                                            [5, 4], out["logprobs"], out["logprob_token_ids"],
                                                            out["actual_logprobs"], out["actual_token_ids"]):
            rows = hf_logprobs(hf, seq)
            assert len(lps) == len(seq) - start and actual_ids == [[t] for t in seq[start:]]
            for i, pos in enumerate(range(start, len(seq))):
                top = rows[pos - 1].topk(5)
                assert ids[i] == top.indices.tolist(), name
                assert np.allclose(lps[i], top.values.tolist(), atol=TOL)
                assert abs(actual[i][0] - rows[pos - 1, seq[pos]].item()) < TOL
    # TRL's default top_logprobs=100 is over the engine's 20 (vLLM's default --max-logprobs too)
    err = trl["scored_top100"]
    assert err["error"] == "Exception" and "400" in err["message"] and "prompt_logprobs" in err["message"]


def test_world_size_server_info_reset_and_weight_sync_on_cpu(trl):
    assert trl["world_size"] == 1
    info = trl["server_info"]
    assert info["weight_transfer_config"] == {"backend": "gloo"}
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert trl["reset"] is None  # /reset_prefix_cache answered JSON (TRL calls .json() on it)
    # init_communicator got past /server_info and /get_world_size, then stopped at TRL's own
    # CUDA check: its weight sync is vLLM's NCCL engine (see rollout/compat/trl.py)
    assert trl["init_communicator"]["error"] == "NotImplementedError"
    assert "CUDA" in trl["init_communicator"]["message"]


def test_structured_outputs_are_refused_by_name(trl):
    err = trl["regex"]
    assert "400" in err["message"] and "structured_outputs" in err["message"]


# ---- the OpenAI routes' vLLM fields, read directly --------------------------------------------------
def test_completion_token_id_labels_and_prompt_logprobs(url, hf):
    body = {"prompt": ID_PROMPTS[0], "max_tokens": 3, "temperature": 0, "logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "prompt_logprobs": 3}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["prompt_token_ids"] == ID_PROMPTS[0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(set(top) >= {f"token_id:{t}"} and all(k.startswith("token_id:") for k in top)
               for top, t in zip(lp["top_logprobs"], choice["token_ids"]))
    prompt_lps = choice["prompt_logprobs"]
    rows = hf_logprobs(hf, ID_PROMPTS[0])
    assert len(prompt_lps) == len(ID_PROMPTS[0]) and prompt_lps[0] is None
    for pos in range(1, len(ID_PROMPTS[0])):
        entries = prompt_lps[pos]
        top = rows[pos - 1].topk(3)
        ranked = sorted(entries.items(), key=lambda kv: kv[1]["rank"])
        actual = str(ID_PROMPTS[0][pos])
        assert actual in entries and all(isinstance(e["rank"], int) for e in entries.values())
        assert [int(k) for k, _ in ranked[:3]] == top.indices.tolist()
        assert [e["rank"] for _, e in ranked[:3]] == [1, 2, 3]
        if int(actual) not in top.indices.tolist():  # outside the top-k: rank k + 1 (a lower bound)
            assert entries[actual]["rank"] == 4 and len(entries) == 4
        for k, e in entries.items():
            assert abs(e["logprob"] - rows[pos - 1, int(k)].item()) < TOL
            assert isinstance(e["decoded_token"], str)
    # without the flag: text labels, as before
    plain = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                                                       "logprobs": 1}, timeout=60).json()["choices"][0]
    assert "".join(plain["logprobs"]["tokens"]) == plain["text"] and "prompt_logprobs" not in plain


def test_chat_prompt_ids_at_top_level_streamed_too(url, tok):
    body = {"messages": CHATS[0], "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["prompt_token_ids"] == chat_ids(tok, CHATS[0])
    choice = r["choices"][0]
    assert "prompt_token_ids" not in choice and len(choice["token_ids"]) == 3
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)
    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == choice["token_ids"]


def test_chat_fields_trl_sends_and_what_is_refused(url):
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": CHATS[0], "max_tokens": 2, "tools": [TOOL],
                                                        "tool_choice": "none"}, timeout=60)
    assert ok.status_code == 200, ok.text
    for extra, param in (({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
                         ({"max_tokenz": 3}, "max_tokenz")):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": CHATS[0], **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_render_answers_vllm_generate_request(url, tok):
    """/v1/chat/completions/render (vLLM's, for TRL's image_features): the prompt's token_ids
    and the sampling params, features null for a text conversation."""
    r = httpx.post(url + "/v1/chat/completions/render", json={"messages": CHATS[1], "max_tokens": 5,
                                                              "temperature": 0.5, "seed": 3}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["token_ids"] == chat_ids(tok, CHATS[1]) and out["features"] is None
    sp = out["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["seed"], sp["n"]) == (5, 0.5, 3, 1)
    unbounded = httpx.post(url + "/v1/chat/completions/render", json={"messages": CHATS[1]}, timeout=60).json()
    info = httpx.get(url + "/server_info").json()
    assert unbounded["sampling_params"]["max_tokens"] == info["max_model_len"] - len(out["token_ids"])


def test_server_info_and_reset_prefix_cache(url):
    info = httpx.get(url + "/server_info", params={"config_format": "json"}).json()
    assert info["model"] and info["max_model_len"] and "weight_version" in info  # our keys stay
    assert info["vllm_config"]["weight_transfer_config"]["backend"] == "gloo"
    assert httpx.get(url + "/server_info", params={"config_format": "yaml"}).status_code == 400
    assert httpx.post(url + "/reset_prefix_cache").json() == {"success": True}


# ---- `trl vllm-serve`'s routes, as TRL 1.10.0's client calls them ------------------------------------
def trl110_sampling(**over) -> dict:
    """The sampling fields trl@1.10.0 VLLMClient.generate / .chat send, at their defaults."""
    return {"n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "max_tokens": 16, "logprobs": 0, "structured_outputs_regex": None, "generation_kwargs": {}, **over}


def test_old_health_and_world_size(url):
    r = httpx.get(url + "/health/")  # check_server's requests.get follows the redirect, reads the status only
    assert r.status_code == 307 and r.headers["location"] == url + "/health"
    assert httpx.get(url + "/health/", follow_redirects=True).json()["status"] == "ok"
    assert httpx.get(url + "/get_world_size/").json() == {"world_size": 1}


def test_old_generate_and_chat(url, trl):
    """POST /generate/ and /chat/ with trl@1.10.0's bodies: the same tokens and logprobs as the
    current client got from /v1/completions and /v1/chat/completions."""
    body = {"prompts": PROMPTS, "images": None, **trl110_sampling(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)}
    r = httpx.post(url + "/generate/", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out, want = r.json(), trl["greedy"]
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "logprob_token_ids"}
    assert out["prompt_ids"] == want["prompt_ids"] and out["completion_ids"] == want["completion_ids"]
    assert out["logprob_token_ids"] == want["logprob_token_ids"]
    assert np.allclose(np.array(out["logprobs"]), np.array(want["logprobs"]), atol=1e-6)

    ids = httpx.post(url + "/generate/", json={"prompts": ID_PROMPTS, "images": None, **trl110_sampling(
        n=2, max_tokens=3, logprobs=None)}, timeout=120).json()
    assert ids["prompt_ids"] == ID_PROMPTS and len(ids["completion_ids"]) == 4 and ids["logprobs"] is None

    chat = {"messages": CHATS, **trl110_sampling(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1),
            "chat_template_kwargs": {}, "tools": None}
    r = httpx.post(url + "/chat/", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_ids"] == trl["chat_greedy"]["prompt_ids"]
    assert r.json()["completion_ids"] == trl["chat_greedy"]["completion_ids"]


def decode_binary(response: dict) -> dict:
    """trl@1.10.0 VLLMClient._decode_binary_logprobs, reproduced."""
    shape = response["shape"]
    arrays = {k: np.frombuffer(base64.b64decode(response[k + "_b64"]), dtype=dtype).reshape(shape[:2] + [last])
              for k, dtype, last in (("logprobs", np.float32, shape[2]), ("token_ids", np.int32, shape[2]),
                                     ("actual_logprobs", np.float32, 1), ("actual_token_ids", np.int32, 1))}
    return {k: [a[i, :n].tolist() for i, n in enumerate(response["completion_lengths"])] for k, a in arrays.items()}


def test_old_get_sequence_logprobs_json_and_binary(url, hf):
    seqs, starts = [ID_PROMPTS[0] + [7, 8, 9], ID_PROMPTS[1] + [10, 11]], [5, 4]
    body = {"sequences": seqs, "prompt_lengths": starts, "top_logprobs": 3, "temperature": 1.0}
    as_json = httpx.post(url + "/get_sequence_logprobs/", json=dict(body, response_format="json"), timeout=120).json()
    binary = decode_binary(httpx.post(url + "/get_sequence_logprobs/", json=dict(body, response_format="binary"),
                                      timeout=120).json())
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        rows = hf_logprobs(hf, seq)
        assert len(as_json["logprobs"][i]) == len(binary["logprobs"][i]) == len(seq) - start
        for j, pos in enumerate(range(start, len(seq))):
            top = rows[pos - 1].topk(3)
            assert binary["token_ids"][i][j] == top.indices.tolist()
            assert np.allclose(binary["logprobs"][i][j], top.values.tolist(), atol=TOL)
            assert binary["actual_token_ids"][i][j] == [seq[pos]]
            assert abs(binary["actual_logprobs"][i][j][0] - rows[pos - 1, seq[pos]].item()) < TOL
            # json: every entry by rank, the actual token last when it is outside the top 3
            want_ids = top.indices.tolist() + ([] if seq[pos] in top.indices.tolist() else [seq[pos]])
            assert as_json["logprob_token_ids"][i][j] == want_ids
            assert np.allclose(as_json["logprobs"][i][j], [rows[pos - 1, t].item() for t in want_ids], atol=TOL)


def test_old_reset_and_weight_routes(url):
    r = httpx.post(url + "/reset_prefix_cache/")
    assert r.status_code == 200 and r.json()["message"].endswith("status: True")
    calls = [("/init_communicator/", {"host": "0.0.0.0", "port": 51216, "world_size": 2, "client_device_uuid": "x"}),
             ("/update_named_param/", {"name": "lm_head.weight", "dtype": "torch.float32", "shape": [4, 4]}),
             ("/close_communicator/", None)]
    for path, body in calls:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 501 and "/init_weight_transfer_engine" in r.json()["detail"], (path, r.text)


def test_old_routes_bad_input_is_a_4xx_in_their_shape(url):
    bad = [("/generate/", {"prompts": PROMPTS, "temperture": 0.5}, "temperture"),
           ("/generate/", {"prompts": PROMPTS, **trl110_sampling(repetition_penalty=1.2)}, "repetition_penalty"),
           ("/generate/", {"prompts": PROMPTS, **trl110_sampling(generation_kwargs={"beam_width": 2})},
            "beam_width"),
           ("/generate/", {"prompts": PROMPTS, **trl110_sampling(structured_outputs_regex="a+")}, "structured"),
           ("/generate/", {"prompts": [[1, 2]], "images": [["aGk="]]}, "images"),
           ("/chat/", {"messages": [[{"role": "user", "content": [{"type": "image_pil", "image_pil": "aGk="}]}]]},
            "image"),
           ("/get_sequence_logprobs/", {"sequences": [[1, 2, 3]], "prompt_lengths": [1, 2]}, "prompt_lengths"),
           ("/get_sequence_logprobs/", {"sequences": [[1, 2, 3]], "prompt_lengths": [4]}, "prompt_lengths[0]"),
           ("/get_sequence_logprobs/", {"sequences": [[1, 2, 3]], "prompt_lengths": [1], "top_logprobs": 50},
            "top_logprobs")]
    for path, body, named in bad:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and named in r.json()["detail"], (path, r.status_code, r.text)
    assert httpx.post(url + "/generate/", json={"prompts": PROMPTS[:1], "max_tokens": 2}, timeout=60).status_code == 200
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    assert {"/generate/", "/chat/", "/get_sequence_logprobs/", "/init_communicator/"} <= set(paths)
