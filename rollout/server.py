"""The HTTP server: `build_app(engine, config)` (FastAPI) and `run_server(config)` (uvicorn).

    client --HTTP--> GuardMiddleware (API keys, body size, request counts)
                     -> routes: rollout/api/{openai,generate,control,weights}.py
                     -> ServerState.generate / engine control calls -> AsyncLLM (engine/)

build_app does not own the engine: run_server creates it, serves, and shuts it down (SIGINT /
SIGTERM: stop accepting, give in-flight requests `shutdown_grace_s` to finish, abort the rest,
which still get a final response with finish_reason "abort", then stop the engine core).
run_server serves in this process, or hands several API servers to rollout/launcher.py, whose
processes enter here again through run_api_server. Every request is logged in one line (method,
path, status, ms; an error's message too) unless ServerConfig.log_requests is off (errors are
logged either way; a successful /health or /metrics poll is not).
"""
import asyncio
import contextlib
import functools
import hmac
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.errors import EngineDeadError
from engine.timeouts import wait_within
from rollout.api import control, generate, logprobs_compare, openai, pooling, sessions, weight_update, weights
from rollout.api.dispatch import document_bodies
from rollout.api.errors import ERROR_SCOPE_KEY, APIError, document_errors, error_body, install_error_handlers
from rollout.api.state import ServerState, get_state
from rollout.compat import DIALECTS
from rollout.config import ServerConfig
from rollout.launcher import read_api_server_spec, run_api_servers
from rollout.listen import banner, listen, url_of
from rollout.log import log
from rollout.metrics import WandbLogger

logger = logging.getLogger("rollout")
OPEN_PATHS = frozenset({"/health", "/ready"})
POLLED_PATHS = frozenset({"/health", "/ready", "/metrics"})  # monitoring polls: logged only when they fail
HEALTH_STATS_TIMEOUT_S = 1.0
READY_STATS_TIMEOUT_S = 5.0
READY_POLL_S = 0.1
MAX_READY_WAIT_S = 600.0
ENGINE_WATCH_S = 0.5


class GuardMiddleware:
    """Pure ASGI (streams pass through untouched): refuses bodies over `max_body_bytes` (413, by
    Content-Length or while reading a chunked body), checks the Bearer key (401; admin routes,
    those tagged "admin", need the admin key: 403 for a valid non-admin key) and counts requests.
    With tracing on, a request's W3C `traceparent` becomes the current OpenTelemetry context
    while it is served: the engine parents the request's span on it (engine/frontend/tracing.py)."""

    def __init__(self, app, config: ServerConfig, state_getter):
        self.app, self.config, self.state_getter = app, config, state_getter
        self.tracing = bool(config.engine_kwargs.get("otlp_traces_endpoint"))
        self.server_header = ((b"x-rollout-api-server", str(config.api_server_index).encode())
                              if config.api_server_count > 1 else None)
        self._admin_paths: frozenset | None = None
        self._known_paths: frozenset | None = None

    def _paths(self, scope) -> tuple[frozenset, frozenset]:
        if self._admin_paths is None:
            routes = list(iter_routes(scope["app"]))
            self._admin_paths = frozenset(path for path, _, tags in routes if "admin" in tags)
            self._known_paths = frozenset(path for path, _, _ in routes)
        return self._admin_paths, self._known_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        admin_paths, known = self._paths(scope)
        t0 = time.perf_counter()
        status_box = [500]
        responded = [False]  # a 413 sent from inside receive(): later sends of the app are dropped

        async def send_counting(message):
            if responded[0]:
                return
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                if self.server_header is not None:  # which of several API servers answered
                    message = dict(message, headers=[*message.get("headers", ()), self.server_header])
            await send(message)

        try:
            denial = self._check_key(scope, path, admin_paths)
            if denial is not None:
                scope[ERROR_SCOPE_KEY] = denial[1]
                return await _send_json(send_counting, *denial)
            limit = self.config.max_body_bytes
            length = dict(scope.get("headers") or []).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                return await _send_json(send_counting, 413, f"the request body ({int(length)} bytes) exceeds the "
                                                            f"limit of {limit} bytes", None)
            received = [0]

            async def receive_limited():
                message = await receive()
                if message["type"] == "http.request" and not responded[0]:
                    received[0] += len(message.get("body", b""))
                    if received[0] > limit:  # a chunked body without Content-Length
                        await _send_json(send_counting, 413, f"the request body exceeds the limit of {limit} "
                                                             "bytes", None)
                        responded[0] = True
                        return {"type": "http.disconnect"}
                return message

            with _trace_context(scope) if self.tracing else contextlib.nullcontext():
                await self.app(scope, receive_limited, send_counting)
        finally:
            state = self.state_getter()
            if state is not None:
                route = path if path in known else "other"
                state.metrics.http_requests.labels(route, str(status_box[0])).inc()
            self._log(scope, status_box[0], time.perf_counter() - t0)

    def _log(self, scope, status: int, seconds: float) -> None:
        """One line per request; an error's message (set by the error handlers) goes with it."""
        error = scope.get(ERROR_SCOPE_KEY) if status >= 400 else None
        if status >= 400 or (self.config.log_requests and scope["path"] not in POLLED_PATHS):
            log(f"{scope['method']} {scope['path']} {status} {seconds * 1e3:.1f} ms" + (f": {error}" if error else ""))

    def _check_key(self, scope, path: str, admin_paths) -> tuple | None:
        cfg = self.config
        if path in OPEN_PATHS or (cfg.api_key is None and cfg.admin_api_key is None):
            return None
        auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        # Once any key is set: admin routes take the admin key only (none set: they are closed),
        # every other route but /health takes the user key or the admin key.
        is_admin = token is not None and cfg.admin_api_key is not None and _same(token, cfg.admin_api_key)
        is_user = token is not None and cfg.api_key is not None and _same(token, cfg.api_key)
        if path in admin_paths:
            if is_admin:
                return None
            if cfg.admin_api_key is None:
                return 403, "admin routes are closed: the server was started with --api-key but no --admin-api-key", \
                    "authorization"
            if is_user:
                return 403, "this route needs the admin API key", "authorization"
            return 401, "missing or wrong admin API key (Authorization: Bearer <key>)", "authorization"
        if is_user or is_admin:
            return None
        return 401, "missing or wrong API key (Authorization: Bearer <key>)", "authorization"


def _trace_context(scope):
    """The request's W3C trace headers as the current OpenTelemetry context (none sent: unchanged)."""
    from engine.frontend.tracing import TRACE_HEADERS, trace_context_from

    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or ()
               if k.decode("latin-1") in TRACE_HEADERS}
    return trace_context_from(headers) if "traceparent" in headers else contextlib.nullcontext()


def iter_routes(app):
    """(path, methods, tags) of every route, including those of included routers (newer FastAPI
    keeps an included router as one `_IncludedRouter` entry in app.routes)."""
    stack = list(app.routes)
    while stack:
        r = stack.pop(0)
        inner = getattr(r, "original_router", None)
        if inner is not None:
            stack[:0] = list(inner.routes)
        elif getattr(r, "path", None) is not None:
            yield r.path, frozenset(getattr(r, "methods", None) or ()), frozenset(getattr(r, "tags", None) or ())


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


async def _send_json(send, status: int, message: str, param: str | None) -> None:
    resp = JSONResponse(error_body(status, message, param), status_code=status,
                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
    await send({"type": "http.response.start", "status": status, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


def build_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an AsyncLLM). It starts the stats poller (and the W&B
    logger) in its lifespan; it never shuts the engine down. No /docs or /redoc: Swagger UI and
    ReDoc load their scripts from a CDN, blank offline; /openapi.json describes every route."""
    config = config or ServerConfig()
    holder: dict = {}
    app = FastAPI(title="rollout", lifespan=_lifespan(engine, config, holder), docs_url=None, redoc_url=None)
    install_error_handlers(app)
    document_errors(app)
    document_bodies(app)
    app.add_middleware(GuardMiddleware, config=config, state_getter=lambda: holder.get("state"))
    app.include_router(info_router)
    for module in (openai, generate, logprobs_compare, pooling, sessions, control, weights, weight_update,
                   *DIALECTS):
        app.include_router(module.router)
        if hasattr(module, "info_router"):
            app.include_router(module.info_router)
    return app


def _lifespan(engine, config: ServerConfig, holder: dict):
    """The app's lifespan: the ServerState (in app.state.rollout and holder["state"]), the LoRA
    adapters named at start, the stats poller, session expiry and the W&B logger."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state = ServerState(engine, config)
        app.state.rollout = holder["state"] = state
        for name, path in config.lora_modules:  # (a bad adapter stops the start-up with its error)
            if name in state.loras:  # loaded by another API server of the launcher's
                continue
            lora = state.new_lora(name, path)
            await engine.add_lora(lora)
            try:
                state.record_lora(lora, replace=False)
            except APIError:  # (that one was quicker)
                await engine.remove_lora(lora.lora_int_id)
        tasks = [asyncio.ensure_future(state.metrics.poll(engine, config.stats_interval_s)),
                 asyncio.ensure_future(state.sessions.expire_forever())]
        wandb_logger = None
        if config.wandb_project:
            wandb_logger = WandbLogger(config.wandb_project, config.wandb_run_name,
                                       {"model": state.model_name, **config.engine_kwargs}, config.wandb_interval_s)
            tasks.append(asyncio.ensure_future(wandb_logger.run_forever(state.metrics)))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await state.sessions.close_all("the server shut down")
            if wandb_logger is not None:
                await state.metrics.refresh(engine, timeout=5.0)  # the last point: the state at shutdown
                await asyncio.to_thread(wandb_logger.finish)

    return lifespan


info_router = APIRouter(tags=["info"])


async def _liveness(engine) -> tuple[dict | None, JSONResponse | None]:
    """The engine's health, or the 503 that says why it has none: dead, or every live replica
    stalled."""
    try:
        health = await engine.check_health()
    except Exception as e:  # noqa: BLE001 - dead (or unreachable) engine
        return None, JSONResponse(error_body(503, f"the engine is not healthy: {e}"), status_code=503)
    stalled = health.get("stalled", [])
    if len(stalled) == len(health["alive"]):
        what = "; ".join(f"replica {s['replica']}: {s['in']} for {s['seconds']} s" for s in stalled)
        return None, JSONResponse(error_body(503, f"the engine is stalled ({what})"), status_code=503)
    return health, None


async def _weights_ready(state, health: dict, min_weight_version: int | None) -> tuple[dict, str | None]:
    """Each live replica's weight version, and why they are not ready (None when they are): a
    replica that holds no weights (a level-2 sleep), or one below the version wanted, which is the
    highest of `min_weight_version`, the server's --min-weight-version and the newest version any
    replica holds (a replica that missed a push, or one a /scale added, is behind until it has it)."""
    stats = await wait_within(state.engine.get_stats(), READY_STATS_TIMEOUT_S)
    replicas = [{"replica": replica, "weight_version": s["weight_version"], "has_weights": s["has_weights"]}
                for replica, s in zip(health["alive"], stats["replicas"])]
    wanted = max(min_weight_version or 0, state.config.min_weight_version, *(r["weight_version"] for r in replicas))
    body = {"weight_version": wanted, "replicas": replicas}
    empty = [r["replica"] for r in replicas if not r["has_weights"]]
    if empty:
        return body, f"replica(s) {empty} hold no weights (slept at level 2): push weights or reload them"
    behind = [r for r in replicas if r["weight_version"] < wanted]
    if behind:
        return body, "; ".join(f"replica {r['replica']} holds weight version {r['weight_version']} < {wanted}"
                               for r in behind)
    return body, None


@info_router.get("/health")
async def health(request: Request, min_weight_version: int | None = Query(None, ge=0)):
    """200 {"status": "ok"} while every replica lives, {"status": "degraded", "dead_replicas",
    "stalled_replicas"} while some serve on; 503 once none does: all dead, or every live one
    stalled (no heartbeat, or stuck in one step or call, for --engine-stall-timeout-s). While
    generation is paused it says for how long ("paused_seconds"): a pause nobody lifts is
    visible to an orchestrator. With `min_weight_version`: also 503 until every replica holds at
    least that version (as /ready)."""
    state = get_state(request)
    engine = state.engine
    health, refusal = await _liveness(engine)
    if refusal is not None:
        return refusal
    dead = sorted(set(health["replicas"]) - set(health["alive"]))
    stalled = health.get("stalled", [])
    body = {"status": "degraded", "dead_replicas": dead, "stalled_replicas": stalled} if dead or stalled \
        else {"status": "ok"}
    if min_weight_version is not None:
        return await _ready_answer(state, health, min_weight_version, body)
    with contextlib.suppress(Exception):  # a busy or dying engine: liveness is the answer
        stats = await wait_within(engine.get_stats(), HEALTH_STATS_TIMEOUT_S)
        if stats["is_paused"]:
            body["paused_seconds"] = round(stats["paused_seconds"], 3)
    return body


@info_router.get("/ready")
async def ready(request: Request, min_weight_version: int | None = Query(None, ge=0),
                wait_s: float = Query(0.0, ge=0, le=MAX_READY_WAIT_S)):
    """200 once the engine lives and every live replica holds weights of the version wanted
    (`min_weight_version`, --min-weight-version, and the newest any replica holds: see
    _weights_ready), 503 naming what is missing until then. For an orchestrator's readiness
    probe, and for a trainer that waits for its push to be everywhere before it samples: with
    `wait_s` the answer waits up to that long for readiness instead of the caller polling."""
    state = get_state(request)
    deadline = time.monotonic() + wait_s
    while True:
        health, answer = await _liveness(state.engine)
        if answer is None:
            answer = await _ready_answer(state, health, min_weight_version, {"status": "ready"})
        if not isinstance(answer, JSONResponse) or time.monotonic() + READY_POLL_S > deadline:
            return answer
        await asyncio.sleep(READY_POLL_S)


async def _ready_answer(state, health: dict, min_weight_version: int | None, ok: dict):
    try:
        body, missing = await _weights_ready(state, health, min_weight_version)
    except asyncio.TimeoutError:
        return JSONResponse(error_body(503, "not ready: the engine did not report its weight versions within "
                                            f"{READY_STATS_TIMEOUT_S:g} s (busy in a step or a call)"), status_code=503)
    if missing is not None:
        answer = error_body(503, f"not ready: {missing}")
        answer["error"].update(body)
        return JSONResponse(answer, status_code=503)
    return {**ok, **body}


@info_router.get("/metrics")
async def metrics(request: Request):
    state = get_state(request)
    await state.metrics.refresh(state.engine, timeout=5.0)
    return Response(state.metrics.prometheus_text(), media_type=CONTENT_TYPE_LATEST)


class _Server(uvicorn.Server):
    """uvicorn.Server that prints one ready line, drains in-flight requests on shutdown, and
    does not re-raise the caught signal (run_server returns normally)."""

    def __init__(self, config: uvicorn.Config, on_ready, on_shutdown):
        super().__init__(config)
        self._on_ready, self._on_shutdown = on_ready, on_shutdown

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_ready()

    async def shutdown(self, sockets=None) -> None:
        async def drain_logged():
            try:
                await self._on_shutdown()
            except Exception:  # noqa: BLE001 - uvicorn's own timeout still ends the shutdown
                logger.exception("draining in-flight requests failed")

        drain = asyncio.ensure_future(drain_logged())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def serve(config: ServerConfig, sock: socket.socket | None = None, connection=None, on_ready=None) -> None:
    """Load the engine (start its engine cores, or attach to `connection`'s), serve on `sock`
    (bound from the config by default) until SIGINT/SIGTERM, shut everything down."""
    sock = sock or listen(config)
    engine = _load_engine(config, connection)
    try:
        app = build_app(engine, config)
        ucfg = uvicorn.Config(app, log_level=config.log_level, access_log=False, lifespan="on",
                              timeout_graceful_shutdown=int(config.shutdown_grace_s) + 10, timeout_keep_alive=30)
        url = url_of(sock)

        def print_ready():
            print(banner(config, app.state.rollout.model_name, url, engine.config, engine.max_model_len), flush=True)

        server = _Server(ucfg, on_ready or print_ready, functools.partial(_drain, app, engine, config))
        watcher = asyncio.ensure_future(_exit_when_engine_dies(engine, server, app)) \
            if config.exit_on_engine_death else None
        await server.serve(sockets=[sock])
        if watcher is not None:
            watcher.cancel()
        if engine.errored and config.exit_on_engine_death:
            raise EngineDeadError(engine.dead_error or engine.client.dead_reason)
    finally:
        sock.close()
        engine.shutdown()
        log("stopped")


def _load_engine(config: ServerConfig, connection):
    """The AsyncLLM: its own engine cores, loaded now (and logged), or those of `connection`."""
    from engine.frontend.async_llm import AsyncLLM

    t0 = time.perf_counter()
    if connection is None:
        log(f"loading the model {config.model or '(default: SmolLM2-135M-Instruct)'} ...")
    engine = AsyncLLM(config.model, connection=connection, **config.engine_kwargs)
    if connection is None:
        c = engine.config
        log(f"{c.model_config.architecture} from {c.model} ({c.dtype}, {c.device}, max_model_len "
            f"{engine.max_model_len}) loaded in {time.perf_counter() - t0:.1f} s")
    return engine


async def _drain(app, engine, config: ServerConfig) -> None:
    """On SIGINT/SIGTERM: refuse new requests, close the sessions, give those in flight
    shutdown_grace_s, then abort the rest (they still get a final "abort" response)."""
    state = getattr(app.state, "rollout", None)
    if state is None:
        return
    state.shutting_down.set()
    engine.cancel_scale()  # a scale-up would hold the shutdown until its new replicas are up
    await state.sessions.close_all("the server is shutting down")
    log(f"shutting down: {len(state.in_flight)} request(s) in flight get {config.shutdown_grace_s:g} s")
    deadline = time.monotonic() + config.shutdown_grace_s
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for _ in range(100):  # the rest (also those waiting on a pause) end with a final "abort"
        if not state.in_flight:
            break
        await state.abort_all_in_flight()
        await asyncio.sleep(0.05)


async def _exit_when_engine_dies(engine, server: uvicorn.Server, app) -> None:
    while not engine.errored:
        await asyncio.sleep(ENGINE_WATCH_S)
    log(f"the engine died ({engine.dead_error or engine.client.dead_reason}): exiting (status 1) so that an "
        "orchestrator restarts the server")
    state = getattr(app.state, "rollout", None)
    if state is not None:
        state.metrics.engine_died()
    server.should_exit = True


def run_server(config: ServerConfig) -> int:
    """`rollout serve`: one API server in this process, or --api-server-count of them
    (rollout/launcher.py). Returns the exit status."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.api_server_count > 1:
        return run_api_servers(config)
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    except EngineDeadError:
        return 1
    except (ValueError, OSError) as e:  # bad engine options, unknown model, port in use
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run_api_server(spec_json: str) -> None:
    """Entry point of API-server process k, started by the launcher (launcher.api_server_command)."""
    config, connection, sock, ready = read_api_server_spec(spec_json)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s api-server-{config.api_server_index}: %(message)s")
    try:
        asyncio.run(serve(config, sock=sock, connection=connection, on_ready=ready))
    except KeyboardInterrupt:
        pass
    finally:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())
