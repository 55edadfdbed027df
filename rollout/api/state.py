"""ServerState: what the routes share (one per app, in `app.state.rollout`): the engine, the
config, metrics, the generation requests in flight, and (SharedState, the same in every API
server) LoRA adapters by name and the weight update under way. Pause and sleep state are not
here: the engine core owns them and the routes ask it. The open sessions are
in `sessions` (rollout/api/session_store.py).

`generate()` here is the only path from a route to `AsyncLLM.generate`: it tracks the request
(for /abort_requests and shutdown), records metrics, and turns engine exceptions into
APIErrors (the routes prime a stream before sending headers, so an engine refusal, e.g. 409
while asleep, is still a clean error response).
"""
import asyncio
import copy
import fcntl
import json
import os
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from fastapi import Request

from engine.frontend.outputs import RequestOutput
from engine.process.replicas import Route
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.worker.lora import LoRARequest
from rollout.api.abort_manifest import RecentlyEnded, RequestRecord
from rollout.api.errors import APIError, engine_error
from rollout.api.idempotency import KeyedCalls
from rollout.api.session_store import Sessions
from rollout.config import ServerConfig
from rollout.metrics import ServerMetrics


@dataclass
class WeightUpdate:
    """A /start_weight_update .. /finish_weight_update sequence in progress."""

    started: float
    version_before: int  # the live version when it started: the finish's version must exceed it
    num_updates: int = 0
    weight_version: int | None = None


class ControlLock:
    """The control routes' turn (pause, resume, sleep, wake, weight updates): one at a time in
    this API server, and with several API servers (rollout/launcher.py) across all of them, by an
    exclusive flock on the file `path` that each one opens. Without that, a sleep through one
    server could land between another's stage and commit, and with several replicas leave them
    on different versions. The kernel drops a dead server's lock."""

    POLL_S = 0.005  # (flock cannot be awaited: a waiter polls, and stays cancellable)

    def __init__(self, path: str | None = None):
        self._local = asyncio.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600) if path else None

    async def acquire(self) -> bool:
        await self._local.acquire()
        try:
            while self._fd is not None:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(self.POLL_S)
        except BaseException:  # (cancelled while another server held it)
            self._local.release()
            raise
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._local.release()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()


T = TypeVar("T")


class SharedState:
    """What the routes keep between calls beyond the engine's own state: the vLLM-phases update
    under way, the SGLang dialect's named weight group, and the LoRA adapters loaded by name with
    their engine ids. With several API servers (ServerConfig.control_lock set) it is one JSON
    document beside the control lock that every server reads: a trainer's calls may land on any
    server (each new connection goes to whichever accepts it), and an adapter's id must mean one
    adapter across them, since the engine keeps the first adapter registered under an id. A
    change is read-modify-write under a lock of its own, held for microseconds (never across an
    await), and replaces the document by a rename, so a reader sees one version or the next."""

    def __init__(self, control_lock: str | None = None):
        self.path = None if control_lock is None else str(Path(control_lock).with_suffix(".json"))
        self._lock_fd = None if self.path is None else \
            os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._doc: dict = {}
        self._seen = None  # the file version held in _doc

    def read(self) -> dict:
        """The document (do not change it: `update` does)."""
        if self.path is None:
            return self._doc
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return {}
        if (st.st_ino, st.st_mtime_ns, st.st_size) != self._seen:
            with open(self.path) as f:
                self._doc = json.load(f)
            self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        return self._doc

    def update(self, change: Callable[[dict], T]) -> T:
        """`change(doc)` edits a copy of the document and returns what this returns; if it raises,
        nothing is written."""
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            doc = copy.deepcopy(self.read())
            out = change(doc)
            if self.path is None:
                self._doc = doc
            else:
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(doc, f, default=str)
                os.replace(tmp, self.path)
            return out
        finally:
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)


class ServerState:
    def __init__(self, engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics()
        self.model_name = config.served_model_name or _model_name(engine)
        self.in_flight: dict[str, float] = {}  # request id -> arrival (monotonic)
        # what each caller in flight received so far (the manifest of /abort_requests wait: true)
        self.records: dict[str, RequestRecord] = {}
        self.recently_ended = RecentlyEnded()
        self.shutting_down = asyncio.Event()
        self.control_lock = ControlLock(config.control_lock)  # pause/resume/sleep/wake/weight routes: one at a time
        self.shared = SharedState(config.control_lock)
        self.weight_updates = KeyedCalls(self.shared)  # POST /weights/update's answers by idempotency_key
        self.sessions = Sessions(self, config.session_timeout_s, config.max_sessions)

    # ---- shared across API servers (SharedState) -------------------------------------------------
    @property
    def weight_update(self) -> WeightUpdate | None:
        """The /start_weight_update .. /finish_weight_update sequence under way, if one is."""
        upd = self.shared.read().get("weight_update")
        return None if upd is None else WeightUpdate(**upd)

    @weight_update.setter
    def weight_update(self, upd: WeightUpdate | None) -> None:
        self.shared.update(lambda doc: doc.update(weight_update=None if upd is None else asdict(upd)))

    def count_weight_update(self, version_before: int, weight_version: int | None) -> None:
        """One more /update_weights in the sequence under way (opening one if none is: vLLM's
        older protocol has no start phase)."""
        def count(doc: dict) -> None:
            upd = doc.get("weight_update") or asdict(WeightUpdate(time.monotonic(), version_before))
            upd["num_updates"] += 1
            upd["weight_version"] = weight_version
            doc["weight_update"] = upd

        self.shared.update(count)

    @property
    def weight_group_name(self) -> str | None:
        """The SGLang dialect's named weight group, while one is open."""
        return self.shared.read().get("weight_group_name")

    @weight_group_name.setter
    def weight_group_name(self, name: str | None) -> None:
        self.shared.update(lambda doc: doc.update(weight_group_name=name))

    @property
    def loras(self) -> dict[str, LoRARequest]:
        """The LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter)."""
        return {name: LoRARequest(name, i, path) for name, (i, path) in self.shared.read().get("loras", {}).items()}

    def new_lora(self, name: str, path: str) -> LoRARequest:
        """A LoRA adapter's request under an id no adapter had before on this server (any API
        server); `record_lora` names it once the engine took it. Its name must not be one the
        model answers to (resolve_model would never reach it, /v1/models would list the id
        twice): 400."""
        if name in self.model_names:
            raise APIError(400, f"lora_name {name!r} is a name of the served model (it answers to "
                                f"{sorted(self.model_names)}): give the adapter another name", "lora_name")

        def allocate(doc: dict) -> int:
            doc["next_lora_id"] = doc.get("next_lora_id", 1) + 1
            return doc["next_lora_id"] - 1

        return LoRARequest(name, self.shared.update(allocate), path)

    def record_lora(self, lora: LoRARequest, replace: bool) -> LoRARequest | None:
        """Serve `lora` under its name; returns the adapter it replaced. An adapter of that name
        loaded meanwhile (through another API server) and `replace` False: 400, nothing changes."""
        def record(doc: dict) -> LoRARequest | None:
            loras = doc.setdefault("loras", {})
            old = loras.get(lora.lora_name)
            if old is not None and not replace:
                raise APIError(400, f"the LoRA adapter {lora.lora_name!r} is already loaded", "lora_name")
            loras[lora.lora_name] = [lora.lora_int_id, lora.lora_path]
            return None if old is None else LoRARequest(lora.lora_name, *old)

        return self.shared.update(record)

    def forget_lora(self, name: str) -> LoRARequest | None:
        """Stop serving the adapter `name`; returns it (None if none was)."""
        def forget(doc: dict) -> LoRARequest | None:
            old = doc.get("loras", {}).pop(name, None)
            return None if old is None else LoRARequest(name, *old)

        return self.shared.update(forget)

    @property
    def model_names(self) -> set[str]:
        """What a request's `model` may say to mean the served model itself."""
        return {name for name in (self.model_name, self.model_path) if name}

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The `model` field of a request: the served model (None) or a loaded LoRA adapter; 404 otherwise."""
        if model is None or model in self.model_names:
            return None
        loras = self.loras  # (read once: it is built from the shared document)
        if model in loras:
            return loras[model]
        raise APIError(404, f"the model {model!r} does not exist (this server serves {self.model_name!r}"
                            + (f" and the LoRA adapters {sorted(loras)}" if loras else "") + ")",
                       "model", type="model_not_found")

    @property
    def model_path(self) -> str:
        return str(getattr(getattr(self.engine, "config", None), "model", "") or "")

    # ---- generation ------------------------------------------------------------------------------
    def new_request_id(self, given: str | None, prefix: str) -> str:
        rid = given or f"{prefix}-{uuid.uuid4().hex[:16]}"
        if rid in self.in_flight:
            raise APIError(400, f"request id {rid!r} is already in use", "request_id")
        return rid

    def check_can_generate(self) -> None:
        if self.shutting_down.is_set():
            raise APIError(503, "the server is shutting down")

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       param: str = "prompt", lora_request: LoRARequest | None = None,
                       cache_salt: str | None = None, route: Route | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """AsyncLLM.generate with tracking, metrics and error translation (`param` names the
        request field a prompt error is about); lora_request: a LoRA adapter to run with;
        cache_salt, route: as AsyncLLM.generate takes them."""
        self.check_can_generate()
        arrival = time.monotonic()
        first_token: float | None = None
        num_tokens = [0] * params.n
        prompt_len, reasons = 0, []
        record = self.track(request_id, arrival, params)
        self.metrics.request_started()
        delta = params.output_kind == RequestOutputKind.DELTA
        try:
            async for out in self.engine.generate(prompt, params, request_id, lora_request=lora_request,
                                                  cache_salt=cache_salt, route=route):
                prompt_len = len(out.prompt_token_ids)
                first_token = out.first_token_time  # also right when only the final output comes
                for c in out.outputs:
                    num_tokens[c.index] = num_tokens[c.index] * delta + len(c.token_ids)
                record.see(out)
                if out.finished:
                    reasons = [c.finish_reason for c in out.outputs]
                    record.ended.set()  # (its caller has it now: an abort's manifest need not wait longer)
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            record.error = str(e)
            raise engine_error(e, param) from e
        finally:
            self.untrack(request_id)
            self.metrics.request_ended()
            if reasons:
                self.metrics.observe_request(arrival, first_token, prompt_len, sum(num_tokens), reasons)

    def track(self, request_id: str, arrival: float, params: SamplingParams) -> RequestRecord:
        """Count the request as in flight, with a record of what its caller receives."""
        self.in_flight[request_id] = arrival
        record = self.records[request_id] = RequestRecord(request_id, params.output_kind == RequestOutputKind.DELTA,
                                                          params.n)
        return record

    def untrack(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        record = self.records.pop(request_id, None)
        if record is not None:
            record.ended.set()
        self.recently_ended.add(request_id)

    async def abort_all_in_flight(self) -> int:
        ids = list(self.in_flight)
        if ids:
            await self.engine.abort(ids)
        return len(ids)


def request_route(request: Request) -> Route | None:
    """The replica a request asks for in its headers: `X-data-parallel-rank` (vLLM's: pin to a
    replica) or `X-Session-ID` (every request of a session on one replica, for its prefix hits;
    what SkyRL's router and vllm-router key on)."""
    rank, session = request.headers.get("x-data-parallel-rank"), request.headers.get("x-session-id")
    if rank is None and not session:
        return None
    if rank is not None:
        try:
            rank = int(rank)
        except ValueError:
            raise APIError(400, f"the X-data-parallel-rank header must be an integer, got {rank!r}",
                           "X-data-parallel-rank") from None
    return Route(rank, session or None)


def get_state(request: Request) -> ServerState:
    return request.app.state.rollout


def _model_name(engine) -> str:
    path = getattr(getattr(engine, "config", None), "model", None)
    return Path(str(path)).name if path else "default"
