"""Request tracing with OpenTelemetry, as vLLM offers it: one span per finished request, named
"llm_request" (kind SERVER), from the request's arrival at the frontend to its end, a child of
the caller's span when the request brought a W3C `traceparent` (AsyncLLM.generate's
`trace_headers`, or the OpenTelemetry context current when generate() is called: the HTTP server
sets it from the request's headers). Off unless EngineConfig.otlp_traces_endpoint is set (`rollout
serve --otlp-traces-endpoint URL`); spans are then batched and POSTed as OTLP HTTP/protobuf by the
SDK's background thread. The SDK is an optional dependency (`pip install 'rollout[tracing]'`),
imported only when tracing is on.

Attribute names are vLLM's (vllm/tracing.py SpanAttributes), so dashboards built on vLLM's traces
read ours; finish reasons and cached prompt tokens take the OpenTelemetry GenAI conventions' names;
the weight versions are ours. The latencies, in seconds:

    time_in_queue            first scheduled - arrival                in the engine core (a pause's
    time_in_model_prefill    first token - first scheduled            hold counts as queue); each a
    time_in_model_decode     last token - first token                 difference of the core's clock
    time_in_model_inference  last token - first scheduled
    time_to_first_token      first token here - arrival here          in the frontend
    e2e                      end here - arrival here

Nothing here runs per token: the engine core sends its two times with a request's first token
(EngineCoreOutput.timings), the output processor keeps them and the core's clock at that token in
a branch it takes once per request anyway, and calls RequestTracer.emit once, when the request
ends (finished or aborted). A time the request never reached (no token yet) is left out.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Mapping

logger = logging.getLogger("engine")
SPAN_NAME = "llm_request"  # vLLM's
TRACE_HEADERS = ("traceparent", "tracestate")
INSTALL_HINT = "pip install 'rollout[tracing]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"


class SpanAttributes:
    # vLLM's names (vllm/tracing.py)
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # the OpenTelemetry GenAI semantic conventions' names
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # one per sequence (n of them)
    GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # prompt tokens from the prefix cache
    # ours: the weight versions of the request's first and last sampled tokens (over its n sequences)
    ROLLOUT_WEIGHT_VERSION_FIRST = "rollout.weight_version.first"
    ROLLOUT_WEIGHT_VERSION_LAST = "rollout.weight_version.last"


def check_otlp_endpoint(endpoint: str) -> None:
    """ValueError unless `endpoint` is an http(s) URL and the OpenTelemetry SDK and its OTLP HTTP
    exporter are installed (the message names what to install)."""
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"otlp_traces_endpoint must be the http(s) URL of an OTLP HTTP/protobuf collector "
                         f"(e.g. http://localhost:4318/v1/traces), got {endpoint!r}")
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ValueError(f"tracing (otlp_traces_endpoint) needs the OpenTelemetry SDK, which is not installed "
                         f"({e}): {INSTALL_HINT}") from None


class RequestTracer:
    """Makes the spans. `tracer` is an OpenTelemetry Tracer; `provider` (its TracerProvider, when
    this object owns it) is flushed and shut down by shutdown()."""

    def __init__(self, tracer, provider=None):
        self.tracer, self.provider = tracer, provider

    @classmethod
    def otlp(cls, endpoint: str) -> RequestTracer:
        """Spans batched to an OTLP HTTP/protobuf collector at `endpoint` (the full URL, e.g.
        http://localhost:4318/v1/traces). OTEL_* environment variables of the SDK (service name,
        batch delay, exporter headers) apply."""
        check_otlp_endpoint(endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "rollout"})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider.get_tracer("engine.frontend"), provider)

    @staticmethod
    def parent_context(trace_headers: Mapping[str, str] | None) -> Any:
        """The parent of a new request's span: from its W3C trace headers, else the current context."""
        from opentelemetry import context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if trace_headers:
            carrier = {k.lower(): v for k, v in trace_headers.items() if k.lower() in TRACE_HEADERS}
            if carrier:
                return TraceContextTextMapPropagator().extract(carrier)
        return context.get_current()

    def emit(self, state, last_core_time: float) -> None:
        """The span of a request that just ended. `last_core_time`: the core's clock when its last
        token was sampled (0.0 when the end came from elsewhere: an abort)."""
        from opentelemetry.trace import SpanKind

        try:
            now = time.monotonic()
            to_ns = time.time_ns() - int(now * 1e9)  # monotonic seconds -> epoch nanoseconds
            attributes = request_attributes(state, now, last_core_time)
            span = self.tracer.start_span(SPAN_NAME, context=state.trace_context, kind=SpanKind.SERVER,
                                          attributes=attributes, start_time=to_ns + int(state.arrival_time * 1e9))
            span.end(end_time=to_ns + int(now * 1e9))
        except Exception:  # noqa: BLE001 - a span must never fail the request or the output handler
            logger.exception("tracing: the span of request %r failed", state.request_id)

    def shutdown(self) -> None:
        """Export what is still batched, then stop (the exporter's own timeout bounds it); once."""
        provider, self.provider = self.provider, None
        if provider is not None:
            provider.shutdown()


@contextlib.contextmanager
def trace_context_from(trace_headers: Mapping[str, str]):
    """Inside, the current OpenTelemetry context is the one these W3C headers carry: generate()
    called there parents its span on it (the HTTP server wraps each request in this)."""
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    token = context.attach(TraceContextTextMapPropagator().extract(trace_headers))
    try:
        yield
    finally:
        context.detach(token)


def request_attributes(state, now: float, last_core_time: float) -> dict[str, Any]:
    """The span's attributes for a request that ended at `now` (frontend clock)."""
    A = SpanAttributes
    p = state.params
    seqs = [s for s in state.seqs if s.weight_versions]
    attrs: dict[str, Any] = {
        A.GEN_AI_REQUEST_ID: state.request_id,
        A.GEN_AI_REQUEST_TEMPERATURE: float(p.temperature),
        A.GEN_AI_REQUEST_TOP_P: float(p.top_p),
        A.GEN_AI_REQUEST_N: len(state.seqs),
        A.GEN_AI_USAGE_PROMPT_TOKENS: len(state.prompt_token_ids),
        A.GEN_AI_USAGE_COMPLETION_TOKENS: sum(len(s.token_ids) for s in state.seqs),
        A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: state.num_cached_tokens,
        A.GEN_AI_RESPONSE_FINISH_REASONS: [s.finish_reason or "abort" for s in state.seqs],
        A.GEN_AI_LATENCY_E2E: now - state.arrival_time,
    }
    if p.max_tokens is not None:
        attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = p.max_tokens
    if seqs:  # over n sequences: the earliest first token's (smallest) and the latest last token's
        attrs[A.ROLLOUT_WEIGHT_VERSION_FIRST] = min(s.weight_versions[0] for s in seqs)
        attrs[A.ROLLOUT_WEIGHT_VERSION_LAST] = max(s.weight_versions[-1] for s in seqs)
    if state.first_token_time is not None:
        attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = state.first_token_time - state.arrival_time
    if state.core_timings is not None and state.core_timings[1] > 0:
        queued, scheduled = state.core_timings
        first = state.first_token_core_time
        attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] = scheduled - queued
        if first > 0:
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first - scheduled
        if first > 0 and last_core_time > 0:
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last_core_time - first
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last_core_time - scheduled
    return attrs
