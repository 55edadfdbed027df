"""Metrics: one `ServerMetrics` per server, exported to Prometheus (/metrics) and, when asked,
to Weights & Biases (`WandbLogger`, the same series every few seconds).

Two sources: the server's own events (requests, time to first token, pause and weight-push
durations), recorded as they happen; and the engine core's counters and state
(`AsyncLLM.get_stats()`: queue depth, KV usage, prefix hit rate, tokens generated, weight
version, pause and sleep state), polled every `stats_interval_s` and again on every scrape. Throughput is the generated-token rate between
two polls. Each server has its own CollectorRegistry (no global state: several servers, or a
test, can live in one process). wandb is imported only when a project is given.
"""
import asyncio
import logging
import netrc
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.frontend.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, ENGINE_LABELED_COUNTERS, LATENCY_BUCKETS, PREFIX
from engine.timeouts import wait_within

logger = logging.getLogger("rollout")

class _EngineCollector:
    """Exposes the latest polled engine stats at scrape time."""

    def __init__(self, metrics: "ServerMetrics"):
        self.m = metrics

    def collect(self):
        s = self.m.engine_stats
        for key, (name, doc) in ENGINE_COUNTERS.items():
            if key in s:
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(s[key]))
        families: dict[str, CounterMetricFamily] = {}  # one family per name, a sample per label set
        for key, (name, doc, labels) in ENGINE_LABELED_COUNTERS.items():
            if key in s:
                family = families.setdefault(name, CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels)))
                family.add_metric(list(labels.values()), float(s[key]))
        yield from families.values()
        for key, (name, doc) in ENGINE_GAUGES.items():
            if key in s:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(s[key]))
        yield GaugeMetricFamily(f"{PREFIX}_generation_throughput_tokens_per_s",
                                "Generated tokens per second over the last stats interval", value=self.m.throughput)
        yield GaugeMetricFamily(f"{PREFIX}_engine_healthy", "0 once the engine is dead", value=float(self.m.healthy))


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.requests_finished = Counter(f"{PREFIX}_requests_finished", "Generation requests by finish reason",
                                         ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "Tokens returned to callers", registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Generation requests the server is serving "
                               "(includes those waiting while paused)", registry=r, multiprocess_mode="livesum")
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.pause_seconds = Histogram(f"{PREFIX}_pause_duration_seconds", "Time generation stayed paused "
                                       "(pause to resume)", buckets=LATENCY_BUCKETS, registry=r)
        self.pause_call_seconds = Histogram(f"{PREFIX}_pause_call_seconds", "Time a /pause call took "
                                            "(draining or aborting in-flight requests)", buckets=LATENCY_BUCKETS,
                                            registry=r)
        self.push_seconds = Histogram(f"{PREFIX}_weight_update_duration_seconds", "Weight updates, start to finish",
                                      ["source"], buckets=LATENCY_BUCKETS, registry=r)
        self.weight_updates = Counter(f"{PREFIX}_weight_updates", "Successful weight updates", ["source"], registry=r)
        self.engine_stats: dict = {}
        self.throughput = 0.0
        self.healthy = True
        self._last_poll: tuple[float, int] | None = None  # (time, num_generated_tokens)
        self._last: dict[str, float] = {}  # latest durations, for W&B
        self.totals = {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0}
        self.num_in_flight = 0
        r.register(_EngineCollector(self))

    # ---- events ---------------------------------------------------------------------------------
    def observe_request(self, arrival: float, first_token: float | None, prompt_tokens: int,
                        completion_tokens: int, finish_reasons: list[str]) -> None:
        now = time.monotonic()
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            self._last["ttft_s"] = first_token - arrival
        self.e2e.observe(now - arrival)
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.totals["prompt_tokens"] += prompt_tokens
        self.totals["completion_tokens"] += completion_tokens
        self.totals["requests"] += 1
        for r in finish_reasons:
            self.requests_finished.labels(r or "unknown").inc()

    def request_started(self) -> None:
        self.num_in_flight += 1
        self.in_flight.inc()

    def request_ended(self) -> None:
        self.num_in_flight -= 1
        self.in_flight.dec()

    def observe_pause(self, seconds: float | None) -> None:
        """A pause ended after `seconds` (None: nothing was paused)."""
        if seconds is None:
            return
        self.pause_seconds.observe(seconds)
        self._last["pause_s"] = seconds

    def observe_push(self, source: str, seconds: float) -> None:
        self.push_seconds.labels(source).observe(seconds)
        self.weight_updates.labels(source).inc()
        self._last["weight_update_s"] = seconds

    def engine_died(self) -> None:
        """No replica lives: engine_healthy 0, and no gauge keeps claiming running work (they are
        set even if no poll had reported them yet: an engine can die before the first one)."""
        self.healthy = False
        self.throughput = 0.0
        for k in ("num_running", "num_waiting", "kv_usage", "is_paused", "paused_seconds"):
            self.engine_stats[k] = 0

    # ---- engine polling ---------------------------------------------------------------------------
    def update_engine_stats(self, stats: dict) -> None:
        now = time.monotonic()
        gen = int(stats.get("num_generated_tokens", 0))
        if self._last_poll is not None and now - self._last_poll[0] >= 0.2:
            t, g = self._last_poll
            self.throughput = max(0, gen - g) / (now - t)
        if self._last_poll is None or now - self._last_poll[0] >= 0.2:
            self._last_poll = (now, gen)
        self.engine_stats = dict(stats)

    async def refresh(self, engine, timeout: float = 2.0) -> None:
        try:
            self.update_engine_stats(await wait_within(engine.get_stats(), timeout))
            self.healthy = True
        except asyncio.TimeoutError:
            pass  # the core is busy (a weight push blocks it): keep the last stats
        except Exception as e:  # noqa: BLE001 - a dead engine shows as engine_healthy 0
            from engine.errors import EngineDeadError
            if isinstance(e, EngineDeadError) or getattr(engine, "errored", False):
                self.engine_died()
            else:
                logger.debug("get_stats failed: %s", e)

    async def poll(self, engine, interval_s: float) -> None:
        while True:
            await self.refresh(engine, timeout=max(interval_s, 1.0))
            await asyncio.sleep(interval_s)

    # ---- export -------------------------------------------------------------------------------------
    def prometheus_text(self) -> bytes:
        """Exposition: this server's metrics, or with several API servers (PROMETHEUS_MULTIPROC_DIR
        set by the launcher) the sum over all of them; the engine series either way."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(_EngineCollector(self))
        return generate_latest(registry)

    def snapshot(self) -> dict:
        """The same series as a flat dict (for W&B)."""
        s = self.engine_stats
        out = {f"engine/{k}": float(v) for k, v in s.items() if isinstance(v, (int, float))}
        out.update({"engine/throughput_tokens_per_s": self.throughput,
                    "server/requests_in_flight": float(self.num_in_flight)})
        out.update({f"server/{k}_total": float(v) for k, v in self.totals.items()})
        out.update({f"server/last_{k}": v for k, v in self._last.items()})
        return out


def wandb_has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger:
    """Logs `ServerMetrics.snapshot()` to a W&B run every `interval_s` (offline mode when no API
    key is configured: the run is written under ./wandb/ and can be synced later)."""

    def __init__(self, project: str, run_name: str | None = None, config: dict | None = None,
                 interval_s: float = 5.0):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("--wandb-project needs the `wandb` package: pip install wandb") from e
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_api_key() else "offline")
        self.interval_s = interval_s
        self.run = wandb.init(project=project, name=run_name, config=config or {}, mode=mode,
                              job_type="rollout-server")
        self.mode = mode
        self.step = 0
        self.metrics: ServerMetrics | None = None

    async def run_forever(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.to_thread(self.log, metrics.snapshot())

    def log(self, data: dict) -> None:
        try:
            self.run.log(data, step=self.step)
            self.step += 1
        except Exception as e:  # noqa: BLE001 - metrics must never take the server down
            logger.warning("wandb.log failed: %s", e)

    def finish(self) -> None:
        """One last point (the state at shutdown), then close the run."""
        if self.metrics is not None:
            self.log(self.metrics.snapshot())
        try:
            self.run.finish()
        except Exception as e:  # noqa: BLE001
            logger.warning("wandb finish failed: %s", e)
