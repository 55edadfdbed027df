"""What one request may ask (ServerConfig.max_encode_inputs, max_request_tokens), and the memory
that big requests leave behind.

Fast, on the session server (the default caps: 2048 encode inputs, 2^21 sampled tokens): over
each cap is a 400 naming the field, given before anything is tokenized or run, and the server
serves on.

Slow, a soak on a server of its own with small caps (so a round takes seconds on 2 cores): five
rounds of /v1/embeddings and /pooling at the input cap and one /generate of n x max_tokens at the
token cap. The RSS of the engine core and of the API server after round 5 stays within 10% of
after round 1. The server keeps its default 2 GiB KV cache: before freed blocks that hold no
prefix were reused first, every encode input took a block never used before and committed its
pages, so the core grew by ~95 MB a round here (one 10k-input call committed 1.4 GB of it).
"""
import re
from pathlib import Path

import httpx
import pytest

from tests.rollout.conftest import API_KEY, MAX_MODEL_LEN, children_of, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
DEFAULT_ENCODE_INPUTS, DEFAULT_REQUEST_TOKENS = 2048, 1 << 21


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_over_each_cap_is_a_400_naming_the_field_and_the_server_serves_on(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as c:
        too_many = [[5, 6, 7]] * (DEFAULT_ENCODE_INPUTS + 1)
        for path in ("/v1/embeddings", "/pooling"):
            err = error_of(c.post(path, json={"input": too_many}))
            assert err["param"] == "input" and "2049 inputs" in err["message"]
            assert "--max-encode-inputs" in err["message"]
        # refused before tokenizing: the bad token id in the last input is not what the answer names
        err = error_of(c.post("/v1/embeddings", json={"input": too_many[:-1] + [[10 ** 9]]}))
        assert err["param"] == "input" and "2049 inputs" in err["message"]

        prompts = [[1, 2, 3]] * 5
        sp = {"n": 1024, "max_tokens": MAX_MODEL_LEN - 1, "temperature": 1.0}  # 5 x 1024 x 511 > 2^21
        err = error_of(c.post("/generate", json={"prompt_token_ids": prompts, "sampling_params": sp}))
        assert err["param"] == "sampling_params.max_tokens" and "--max-request-tokens" in err["message"]
        assert str(DEFAULT_REQUEST_TOKENS) in err["message"]
        # max_tokens unset: each prompt may run to the context's end
        err = error_of(c.post("/generate", json={"prompt_token_ids": prompts,
                                                 "sampling_params": dict(sp, max_tokens=None)}))
        assert err["param"] == "sampling_params.max_tokens" and "unset" in err["message"]
        err = error_of(c.post("/v1/completions", json={"prompt": prompts, **sp}))
        assert err["param"] == "max_tokens" and "--max-request-tokens" in err["message"]
        err = error_of(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "n": 1025, "temperature": 1.0, "max_tokens": 4}))
        assert err["param"] == "n"  # n alone: at most 1024 (SamplingParams)

        at_cap = c.post("/generate", json={"prompt_token_ids": [1, 2, 3], "sampling_params": {
            "n": 2, "max_tokens": 4, "temperature": 1.0}})
        assert at_cap.status_code == 200 and len(at_cap.json()["results"][0]["outputs"]) == 2
        r = c.post("/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2


# ---- soak ---------------------------------------------------------------------------------------
SOAK_INPUTS, SOAK_N, SOAK_MAX_TOKENS = 64, 16, 32
ROUNDS, DRIFT = 5, 0.10


def rss_mb(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024


@pytest.mark.slow
def test_big_requests_at_the_caps_leave_memory_flat():
    server = start_server("--max-encode-inputs", str(SOAK_INPUTS),
                          "--max-request-tokens", str(SOAK_N * SOAK_MAX_TOKENS))
    try:
        (core,) = [p for p in children_of(server.proc.pid)
                   if b"run_engine_core" in Path(f"/proc/{p}/cmdline").read_bytes()]
        inputs = [f"soak input number {i}" for i in range(SOAK_INPUTS)]
        # seeded: every round samples the same tokens, so its full blocks repeat cached ones
        # instead of adding prefix-cache entries (which fill the KV pool as designed)
        sp = {"n": SOAK_N, "max_tokens": SOAK_MAX_TOKENS, "temperature": 1.0, "seed": 7, "ignore_eos": True}
        samples = []
        with httpx.Client(base_url=server.url, headers=HEADERS, timeout=300) as c:
            for _ in range(ROUNDS):
                for path in ("/v1/embeddings", "/pooling"):
                    r = c.post(path, json={"input": inputs})
                    assert r.status_code == 200 and len(r.json()["data"]) == SOAK_INPUTS, r.text[:300]
                r = c.post("/generate", json={"prompt_token_ids": [1, 2, 3, 4], "sampling_params": sp})
                assert r.status_code == 200, r.text[:300]
                assert [len(o["token_ids"]) for o in r.json()["results"][0]["outputs"]] == [SOAK_MAX_TOKENS] * SOAK_N
                samples.append((rss_mb(core), rss_mb(server.proc.pid)))
            # one over each cap: refused, and the server is the same afterwards
            assert error_of(c.post("/v1/embeddings", json={"input": inputs + ["one more"]}))["param"] == "input"
            assert error_of(c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "n": SOAK_N, "temperature": 1.0,
                "max_tokens": SOAK_MAX_TOKENS + 1}))["param"] == "max_tokens"
            assert c.post("/pooling", json={"input": inputs[:2]}).status_code == 200
        print("RSS MB after each round (engine core, API server):", [(round(a), round(b)) for a, b in samples])
        for i, name in enumerate(("engine core", "API server")):
            first, last = samples[0][i], samples[-1][i]
            assert last <= first * (1 + DRIFT), f"{name}: RSS {first:.0f} -> {last:.0f} MB in {ROUNDS} rounds {samples}"
    finally:
        assert stop_server(server) == 0, server.log()
