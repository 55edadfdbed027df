"""RL control over HTTP, through RolloutClient: pause (abort returns partial outputs with
finish_reason "abort"; keep freezes and continues), requests that arrive while paused wait for
resume, /abort_requests, sleep / wake_up / is_sleeping, and /metrics (parses; counters move)."""
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout.client import RolloutAPIError

LONG = {"temperature": 0, "max_tokens": 200, "ignore_eos": True, "logprobs": 0}
SHORT = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
PROMPT = "Write a story about a dragon."


def start_stream(client, params=LONG, request_id=None):
    """A streaming /generate in a thread; returns (deltas list, thread, first-token event)."""
    deltas, started = [], threading.Event()

    def run():
        try:
            for _, ds in client.generate_stream(PROMPT, params, request_id=request_id):
                deltas.extend(ds)
                started.set()
        except Exception as e:  # noqa: BLE001 - surfaced by the test
            deltas.append(e)
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(120), "no token within 120 s"
    return deltas, t


def tokens(deltas):
    assert not any(isinstance(d, Exception) for d in deltas), deltas
    return [t for d in deltas for t in d.token_ids]


def generated_tokens(client) -> float:
    for fam in text_string_to_metric_families(client.metrics()):
        for s in fam.samples:
            if s.name == "rollout_generation_tokens_total":
                return s.value
    return 0.0


def test_pause_abort_returns_partial_outputs(client):
    box = {}
    tokens0 = generated_tokens(client)
    t = threading.Thread(target=lambda: box.update(out=client.generate(PROMPT, LONG)[0]), daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while generated_tokens(client) < tokens0 + 2:  # it is generating
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.pause(mode="abort")
    t.join(60)
    out = box["out"]
    assert out.finish_reason == "abort"
    assert 0 < len(out.token_ids) < LONG["max_tokens"]
    assert len(out.logprobs) == len(out.weight_versions) == len(out.token_ids)
    assert client.is_paused()
    # a request that arrives while paused waits, then runs after resume
    late = threading.Thread(target=lambda: box.update(late=client.generate(PROMPT, SHORT)[0]), daemon=True)
    late.start()
    # ... unless it is aborted: it ends at once with "abort" and no tokens
    gone = threading.Thread(target=lambda: box.update(gone=client.generate(PROMPT, SHORT, request_id="gone")[0]),
                            daemon=True)
    gone.start()
    deadline = time.monotonic() + 60
    while client.server_info()["requests_in_flight"] < 2:  # both arrived (abort finds only what arrived)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    late.join(1.0)
    assert late.is_alive(), "a request finished while generation was paused"
    assert client.abort_requests(["gone"]) == 1
    gone.join(30)
    assert box["gone"].finish_reason == "abort" and box["gone"].token_ids == []
    assert late.is_alive()
    client.resume()
    late.join(120)
    assert box["late"].finish_reason == "length" and not client.is_paused()


def test_pause_keep_freezes_and_continues(client):
    # long, so that the pause lands mid-request on any machine (16 tokens may all be out first)
    want = client.generate(PROMPT, LONG)[0].token_ids
    deltas, t = start_stream(client, LONG)
    client.pause(mode="keep")
    n = len(tokens(deltas))
    time.sleep(1.0)
    assert len(tokens(deltas)) <= n + 1, "tokens kept coming while paused (keep)"
    assert t.is_alive()
    client.resume()
    t.join(120)
    assert tokens(deltas) == want  # greedy: frozen and continued = uninterrupted
    assert deltas[-1].finish_reason == "length"


def test_abort_requests_by_id(client):
    deltas, t = start_stream(client, request_id="abort-me")
    assert client.abort_requests(["abort-me", "no-such-request"]) == 1
    t.join(60)
    assert deltas[-1].finish_reason == "abort"
    got = tokens(deltas)
    assert 0 < len(got) < LONG["max_tokens"]
    assert all(d.logprobs is not None and len(d.logprobs) == len(d.token_ids) for d in deltas)
    # the deltas add up to exactly what was generated (the final abort delta repeats nothing)
    assert got == client.generate(PROMPT, dict(LONG, max_tokens=len(got)))[0].token_ids


def test_sleep_and_wake_up(client):
    before = client.generate(PROMPT, SHORT)[0].token_ids
    client.sleep(level=1)
    assert client.is_sleeping()
    with pytest.raises(RolloutAPIError) as e:
        client.generate(PROMPT, SHORT)
    assert e.value.status == 409 and "wake_up" in e.value.message
    client.wake_up(tags=["weights"])
    assert client.is_sleeping()  # the KV cache still sleeps
    client.wake_up(tags=["kv_cache"])
    assert not client.is_sleeping() and not client.is_paused()
    assert client.generate(PROMPT, SHORT)[0].token_ids == before


@pytest.mark.slow
def test_sleep_level_2_then_reload_from_disk(client, model_path):
    before = client.generate(PROMPT, SHORT)[0]
    client.sleep(level=2)
    client.wake_up()
    with pytest.raises(RolloutAPIError) as e:  # the weights are gone until a push or a reload
        client.generate(PROMPT, SHORT)
    assert e.value.status == 409
    version = client.weight_version() + 10
    client.push_weights_from_disk(model_path, version=version)
    after = client.generate(PROMPT, SHORT)[0]
    assert after.token_ids == before.token_ids
    assert set(after.weight_versions) == {version} and client.weight_version() == version


def test_metrics_parse_and_move(client):
    def sample(name, **labels):
        for fam in text_string_to_metric_families(client.metrics()):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    names = {f.name for f in text_string_to_metric_families(client.metrics())}
    for want in ("rollout_generation_tokens", "rollout_num_requests_running", "rollout_num_requests_waiting",
                 "rollout_kv_cache_usage_ratio", "rollout_prefix_cache_hit_rate", "rollout_weight_version",
                 "rollout_generation_throughput_tokens_per_s", "rollout_pause_duration_seconds",
                 "rollout_weight_update_duration_seconds", "rollout_is_sleeping",
                 "rollout_time_to_first_token_seconds"):
        assert want in names, want
    tokens0 = sample("rollout_generation_tokens_total")
    finished0 = sample("rollout_requests_finished_total", finish_reason="length")
    http0 = sample("rollout_http_requests_total", route="/generate", status="200")
    client.generate(PROMPT, SHORT)
    assert sample("rollout_generation_tokens_total") >= tokens0 + SHORT["max_tokens"]
    assert sample("rollout_requests_finished_total", finish_reason="length") == finished0 + 1
    assert sample("rollout_http_requests_total", route="/generate", status="200") == http0 + 1


def test_start_and_stop_profile(client):
    """/start_profile ... /stop_profile writes a torch-profiler trace of the engine core under the
    server's --profiler-dir, with the step's phases labelled; a second stop is a 409."""
    import json

    from tests.rollout.conftest import PROFILER_DIR

    client.start_profile()
    client.generate(PROMPT, SHORT)
    traces = client.stop_profile()
    assert len(traces) == 1 and traces[0].startswith(PROFILER_DIR)
    names = {e.get("name") for e in json.loads(open(traces[0]).read())["traceEvents"]}
    assert {"schedule", "forward", "sample", "outputs"} <= names
    with pytest.raises(RolloutAPIError) as e:
        client.stop_profile()
    assert e.value.status == 409
    assert len(client.generate(PROMPT, SHORT)[0].token_ids) == 6


def test_an_engine_dead_before_its_first_stats_poll_shows_zeroed_gauges():
    """A race tests/rollout/test_lifecycle.py hit on a fast machine: the core died before the
    server polled its stats once, and the dead state must still read as zeros, not as missing
    series."""
    from rollout.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.engine_died()
    text = metrics.prometheus_text().decode()
    for line in ("rollout_engine_healthy 0.0", "rollout_num_requests_running 0.0",
                 "rollout_num_requests_waiting 0.0", "rollout_kv_cache_usage_ratio 0.0", "rollout_is_paused 0.0"):
        assert line in text, line
