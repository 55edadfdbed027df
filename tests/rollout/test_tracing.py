"""OpenTelemetry tracing (engine/frontend/tracing.py, `rollout serve --otlp-traces-endpoint`): one
span per finished request, with the attribute names of vLLM's tracing so that dashboards built on
vLLM's traces read ours. Followed: vLLM's vllm/tracing.py (SpanAttributes: gen_ai.request.id,
gen_ai.usage.prompt_tokens / completion_tokens, gen_ai.latency.time_in_queue / time_to_first_token
/ e2e / time_in_model_prefill / time_in_model_decode, gen_ai.request.temperature / top_p /
max_tokens / n) and vllm/v1/engine/output_processor.py (OutputProcessor.do_tracing: a span named
"llm_request", kind SERVER, from the request's arrival, parented on the request's W3C traceparent).

1. AsyncLLM on a tiny random Llama, spans into the SDK's InMemorySpanExporter: one span per
   request, its numbers those of the RequestOutput (tokens, finish reasons, weight versions,
   cached prompt tokens), the trace_headers' parent, an aborted request's span.
2. A real `rollout serve --otlp-traces-endpoint` posting OTLP HTTP/protobuf to a small collector in
   this test (http.server; bodies decoded with opentelemetry.proto): the spans of /generate and a
   streamed /v1/completions, the traceparent header as their parent.
"""
import asyncio
import gzip
import http.server
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.frontend.async_llm import AsyncLLM  # noqa: E402
from engine.frontend.tracing import SPAN_NAME, RequestTracer  # noqa: E402
from engine.sampling_params import RequestOutputKind  # noqa: E402
from rollout.subprocess_server import rollout_command, served  # noqa: E402
from tests.rollout.conftest import tiny_model_folder  # noqa: E402

TRACE_ID, PARENT_SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
PROMPT = list(range(100, 140))  # 40 tokens: two full KV blocks of 16 to find in the prefix cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path) -> str:
    return tiny_model_folder(tmp_path_factory.mktemp("tiny_traced"), default_model_path)


async def final(gen):
    out = None
    async for out in gen:
        pass
    return out


# ---- 1. AsyncLLM, spans in memory ---------------------------------------------------------------
def test_one_span_per_request_with_the_numbers_of_its_output(tiny):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        llm = AsyncLLM(tiny, dtype="float32", kv_cache_memory=32 << 20)
        try:
            assert not await llm.is_tracing_enabled()  # off by default
            llm.output_processor.tracer = RequestTracer(provider.get_tracer("test"))
            assert await llm.is_tracing_enabled()
            await llm.set_weight_version(7)
            greedy = await final(llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                              "greedy"))
            cached = await final(llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), "cached",
                                              trace_headers={"traceparent": TRACEPARENT}))
            sampled = await final(llm.generate(PROMPT[:5], SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=3,
                                                                           max_tokens=4, ignore_eos=True), "n2"))
            # a version bump in the middle of a request: its first and last tokens differ
            gen = llm.generate(PROMPT[:5], SamplingParams(max_tokens=200, ignore_eos=True), "bumped")
            await gen.__anext__()
            await llm.pause_generation(mode="keep")
            await llm.set_weight_version(8)
            await llm.resume_generation()
            bumped = await final(gen)
            # an abort: the caller walks away after the first output
            gen = llm.generate(PROMPT[:5], SamplingParams(max_tokens=200, ignore_eos=True,
                                                          output_kind=RequestOutputKind.DELTA), "aborted")
            await gen.__anext__()
            await gen.aclose()
            return greedy, cached, sampled, bumped
        finally:
            llm.shutdown()

    greedy, cached, sampled, bumped = asyncio.run(main())
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["aborted", "bumped", "cached", "greedy", "n2"], "one span per request"
    for rid, out in [("greedy", greedy), ("cached", cached), ("n2", sampled), ("bumped", bumped)]:
        span, a = spans[rid], spans[rid].attributes
        assert span.name == SPAN_NAME == "llm_request" and span.kind == SpanKind.SERVER
        assert a["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
        assert a["gen_ai.usage.completion_tokens"] == sum(len(c.token_ids) for c in out.outputs)
        assert list(a["gen_ai.response.finish_reasons"]) == [c.finish_reason for c in out.outputs]
        assert a["gen_ai.usage.cache_read.input_tokens"] == out.num_cached_tokens
        assert a["rollout.weight_version.first"] == min(c.weight_versions[0] for c in out.outputs)
        assert a["rollout.weight_version.last"] == max(c.weight_versions[-1] for c in out.outputs)
        assert a["gen_ai.request.n"] == len(out.outputs)
        # the latencies: all there, consistent with each other and with the span's own interval
        e2e, ttft = a["gen_ai.latency.e2e"], a["gen_ai.latency.time_to_first_token"]
        queue, prefill = a["gen_ai.latency.time_in_queue"], a["gen_ai.latency.time_in_model_prefill"]
        decode, inference = a["gen_ai.latency.time_in_model_decode"], a["gen_ai.latency.time_in_model_inference"]
        assert 0 <= ttft <= e2e and min(queue, prefill, decode) >= 0
        assert inference == pytest.approx(prefill + decode, abs=1e-6) and queue + inference <= e2e
        assert (span.end_time - span.start_time) / 1e9 == pytest.approx(e2e, abs=1e-3)
    a = spans["greedy"].attributes
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.top_p"] == 1.0
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ("length",)
    assert (a["rollout.weight_version.first"], a["rollout.weight_version.last"]) == (7, 7)
    assert cached.num_cached_tokens == 32 and spans["cached"].attributes["gen_ai.usage.cache_read.input_tokens"] == 32
    a = spans["n2"].attributes
    assert (a["gen_ai.request.n"], a["gen_ai.usage.completion_tokens"]) == (2, 8)
    assert a["gen_ai.request.temperature"] == 1.0 and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    a = spans["bumped"].attributes
    assert (a["rollout.weight_version.first"], a["rollout.weight_version.last"]) == (7, 8)
    # parents: the traceparent given, else none (a root span)
    parent = spans["cached"].parent
    assert parent is not None and parent.is_remote
    assert (format(parent.trace_id, "032x"), format(parent.span_id, "016x")) == (TRACE_ID, PARENT_SPAN_ID)
    assert format(spans["cached"].context.trace_id, "032x") == TRACE_ID
    assert spans["greedy"].parent is None
    # the abort: what it had when the caller left (no last token time: no decode latency)
    a = spans["aborted"].attributes
    assert a["gen_ai.response.finish_reasons"] == ("abort",) and a["gen_ai.usage.completion_tokens"] >= 1
    assert "gen_ai.latency.time_in_queue" in a and "gen_ai.latency.time_in_model_decode" not in a


# ---- 2. `rollout serve` posting OTLP to a collector -----------------------------------------------
class Collector(http.server.ThreadingHTTPServer):
    """An OTLP HTTP/protobuf trace receiver: keeps every span POSTed to /v1/traces."""

    def __init__(self):
        self.spans, self.paths = [], []
        super().__init__(("127.0.0.1", 0), CollectorHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def wait_for(self, n: int, timeout_s: float = 30.0) -> list:
        deadline = time.monotonic() + timeout_s
        while len(self.spans) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.spans)


class CollectorHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        self.server.paths.append((self.path, self.headers.get("Content-Type")))
        self.server.spans += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values] \
            if kind == "array_value" else getattr(v, kind)
    return out


def test_serve_exports_spans_over_otlp_with_the_callers_parent(tmp_path, tiny):
    collector = Collector()
    try:
        with served(tiny, "--dtype", "float32", "--otlp-traces-endpoint", collector.url, "--max-model-len", "256",
                    log_path=tmp_path / "serve.log", env={"OTEL_BSP_SCHEDULE_DELAY": "50"}) as server:
            url = server.url
            assert httpx.get(url + "/server_info", timeout=30).json()["tracing"] is True
            body = {"prompt_token_ids": PROMPT[:8], "sampling_params": {"max_tokens": 5, "ignore_eos": True},
                    "request_id": "plain"}
            plain = httpx.post(url + "/generate", json=body, timeout=60).json()["results"][0]
            body = dict(body, request_id="traced", sampling_params={"max_tokens": 3, "temperature": 0.5,
                                                                     "ignore_eos": True})
            traced = httpx.post(url + "/generate", json=body, headers={"traceparent": TRACEPARENT},
                                timeout=60).json()["results"][0]
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            with httpx.stream("POST", url + "/v1/completions", headers={"traceparent": TRACEPARENT},
                              json={"model": model, "prompt": "Hello there", "max_tokens": 4, "stream": True,
                                    "ignore_eos": True}, timeout=60) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
            spans = collector.wait_for(3)
        assert server.proc.returncode == 0, server.log()
    finally:
        collector.shutdown()
    assert len(spans) == 3, [s.name for s in spans]
    assert {p for p in collector.paths} == {("/v1/traces", "application/x-protobuf")}
    by_id = {attributes(s)["gen_ai.request.id"]: s for s in spans}
    assert {"plain", "traced"} <= set(by_id)
    for rid, out in [("plain", plain), ("traced", traced)]:
        span, a = by_id[rid], attributes(by_id[rid])
        c = out["outputs"][0]
        assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
        assert a["gen_ai.usage.prompt_tokens"] == len(out["prompt_token_ids"]) == 8
        assert a["gen_ai.usage.completion_tokens"] == len(c["token_ids"])
        assert a["gen_ai.response.finish_reasons"] == [c["finish_reason"]] == ["length"]
        assert a["rollout.weight_version.first"] == c["weight_versions"][0]
        assert a["rollout.weight_version.last"] == c["weight_versions"][-1]
        assert a["gen_ai.usage.cache_read.input_tokens"] == out["num_cached_tokens"]
        for name in ("e2e", "time_to_first_token", "time_in_queue", "time_in_model_prefill", "time_in_model_decode"):
            assert a[f"gen_ai.latency.{name}"] >= 0, name
    assert attributes(by_id["traced"])["gen_ai.request.temperature"] == 0.5
    assert attributes(by_id["traced"])["gen_ai.request.max_tokens"] == 3
    # the traceparent header's trace and span are the parent, for /generate and a streamed completion
    (streamed,) = [s for rid, s in by_id.items() if rid not in ("plain", "traced")]
    for span in (by_id["traced"], streamed):
        assert (span.trace_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, PARENT_SPAN_ID)
    assert by_id["plain"].parent_span_id == b"" and by_id["plain"].trace_id.hex() != TRACE_ID
    assert attributes(streamed)["gen_ai.usage.completion_tokens"] == 4


def test_serve_refuses_tracing_it_cannot_do_before_loading_the_model():
    """A non-HTTP endpoint, or the SDK missing (its import made to fail), stop `rollout serve` at
    once with status 2 and a message saying what to do."""
    r = subprocess.run(rollout_command() + ["serve", "--otlp-traces-endpoint", "localhost:4317"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "http(s) URL of an OTLP HTTP/protobuf collector" in r.stderr, r.stderr
    code = ("import sys; sys.modules['opentelemetry.sdk.trace'] = None; from rollout.cli import main; "
            "sys.exit(main(['serve', '--otlp-traces-endpoint', 'http://127.0.0.1:4318/v1/traces']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "pip install 'rollout[tracing]'" in r.stderr, r.stderr
