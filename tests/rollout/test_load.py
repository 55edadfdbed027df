"""Load (slow): 256 concurrent /generate streams against a real server whose engine runs at most
32 sequences at once (the rest queue in the engine, as documented: no 429), a quarter of them
cancelled by their clients after a few events, in three waves.

Holds: 0 lost (every stream not cancelled ends with finished and all its tokens), 0 mixed (each
stream's request id and prompt are its own, its greedy tokens are what that prompt gives alone),
0 stuck (afterwards /metrics shows nothing running, waiting or in flight, and the running batch
never exceeded --max-num-seqs), memory flat (the RSS of server + engine core after the third
wave within 5% of after the second). The KV cache is reserved at start and its pages are
committed on first use, so RSS climbs towards the KV size until every block has been used once:
the server runs with a 256 MiB KV cache, which the first wave uses up (preempting as it goes).
"""
import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.rollout.conftest import API_KEY, ADMIN_KEY, children_of, start_server, stop_server

pytestmark = pytest.mark.slow
STREAMS, MAX_NUM_SEQS, PROMPTS = 256, 32, 8
HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


def rss_mb(pid: int) -> float:
    total = 0
    for p in [pid, *children_of(pid)]:
        m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{p}/status").read_text())
        total += int(m.group(1)) if m else 0
    return total / 1024


def metric(text: str, name: str) -> float:
    m = re.search(rf"^rollout_{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"rollout_{name} missing from /metrics"
    return float(m.group(1))


async def one_stream(http: httpx.AsyncClient, i: int, prompt: list[int], max_tokens: int, cancel_after: int | None):
    rid = f"load-{i}"
    body = {"prompt_token_ids": prompt, "request_id": rid, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}}
    tokens, events, finished = [], 0, False
    async with http.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line:
                continue
            event = json.loads(line)
            assert "error" not in event, event
            assert event["request_id"] == rid and event["prompt_token_ids"] == prompt, "a stream got another's output"
            tokens += event["outputs"][0]["token_ids"]
            finished = event["finished"]
            events += 1
            if cancel_after is not None and events >= cancel_after:
                return None  # leaving the context closes the connection: the server aborts the request
    return {"tokens": tokens, "finished": finished}


async def wave(url: str, refs: list[list[int]], prompts: list[list[int]], seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=STREAMS + 8, max_keepalive_connections=STREAMS + 8)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, limits=limits,
                                 timeout=600) as http:
        plan = [(i % PROMPTS, rng.randint(4, 24), rng.randint(1, 3) if rng.random() < 0.25 else None)
                for i in range(STREAMS)]
        results = await asyncio.gather(*(one_stream(http, seed * STREAMS + i, prompts[k], m, c)
                                         for i, (k, m, c) in enumerate(plan)))
    done = 0
    for (k, m, c), r in zip(plan, results):
        if c is None:
            assert r is not None and r["finished"], "a stream was lost"
            assert r["tokens"] == refs[k][:m], "a stream's greedy tokens differ from its prompt's alone"
            done += 1
    return done, sum(c is not None for _, _, c in plan)


def test_256_streams_with_cancellations():
    server = start_server("--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-memory", "256MiB")
    try:
        http = httpx.Client(base_url=server.url, headers=HEADERS, timeout=120)
        prompts = [[1 + k, 30 + k, 700 + 3 * k, 42, 9 + k] for k in range(PROMPTS)]
        refs = [http.post("/generate", json={"prompt_token_ids": p, "sampling_params": {
            "temperature": 0.0, "max_tokens": 24, "ignore_eos": True}}).json()["results"][0]["outputs"][0]["token_ids"]
                for p in prompts]
        peak = {"running": 0.0}

        async def watch_and_run(seed):
            async def watch():
                async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=30) as h:
                    while True:
                        text = (await h.get("/metrics")).text
                        peak["running"] = max(peak["running"], metric(text, "num_requests_running"))
                        await asyncio.sleep(0.2)

            watcher = asyncio.ensure_future(watch())
            try:
                return await wave(server.url, refs, prompts, seed)
            finally:
                watcher.cancel()

        counts, rss = [], []
        for seed in (1, 2, 3):
            counts.append(asyncio.run(watch_and_run(seed)))
            rss.append(rss_mb(server.proc.pid))
        assert all(done + cancelled == STREAMS and cancelled for done, cancelled in counts), counts
        assert 0 < peak["running"] <= MAX_NUM_SEQS, peak
        text = ""
        for _ in range(50):  # the stats poller refreshes every second
            text = http.get("/metrics").text
            if metric(text, "num_requests_running") == metric(text, "num_requests_waiting") == 0 \
                    and metric(text, "requests_in_flight") == 0:
                break
            time.sleep(0.2)
        for name in ("num_requests_running", "num_requests_waiting", "requests_in_flight"):
            assert metric(text, name) == 0, f"{name} stuck at {metric(text, name)} after the load"
        assert abs(rss[2] - rss[1]) / rss[1] < 0.05, f"RSS drifted from {rss[1]:.0f} MB to {rss[2]:.0f} MB"
        print(f"load: 3 x {STREAMS} streams, {sum(c for _, c in counts)} cancelled, peak running "
              f"{peak['running']:.0f}, RSS after each wave {[round(r) for r in rss]} MB")
        assert http.get("/health").status_code == 200
    finally:
        assert stop_server(server) == 0
