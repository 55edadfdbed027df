"""POST /weights/update: a whole weight update in one call, as one transaction (ours: vLLM splits
it into /pause, /start_weight_update, /update_weights, /finish_weight_update, /resume; SGLang into
/pause_generation, /update_weights_from_distributed, /continue_generation):

    receive -> stage -> pause (unless paused) -> swap -> clear caches -> resume

Generation goes on while the bytes arrive and pauses only for the swap (a few ms): the engine
receives beside its steps (EngineConfig.stages_weights_beside_steps: on a CPU, every
tensor-parallel rank too). Where it cannot (CUDA, a LoRA adapter's update) the pause comes first. A caller
that wants nothing generated while it pushes pauses before (POST /pause); the update keeps it.

    POST /weights/update {"source": "gloo" | "nccl" | "disk" | "ipc",
         "update_info": {...}      gloo / nccl (optional): vLLM's update_info of the push that the
                                   trainer's WeightSender sends beside this call, over the group
                                   formed by /init_weight_transfer_engine
         "handles": {"replicas": [...]}  gloo / nccl (optional): a trainer on the machine of some
                                   replicas wrote their part into their leased spares (or a
                                   segment): those read it, the others (the group's, formed with
                                   init_info.replicas) receive the push
         "path": "/abs/folder"     disk: a safetensors folder on the server's disk
         "handles": {...}          ipc: weight_sync.SharedWeights.share()'s handles, or
                                   SpareWriter.write()'s for the spare leased by POST /weights/spare
         "version": v              default: the live version + 1; must increase
         "lora_name": name         the tensors are that loaded LoRA adapter's (its own versions)
         "pause_mode": "keep"      | "abort" | "wait" (as /pause); "recompute_kv": false (with keep)
         "idempotency_key": k, "deadline_s": s}
      -> {"weight_version", "phases": {"queue" (the wait for the control lock), "receive", "stage",
          "pause", "swap", "clear_cache", "resume": seconds, in the order they ran}, "seconds",
          "num_tensors", "num_bytes", "aborted", "kept", "paused_here", "paused_seconds" (how long
          generation stood still), "idempotency_key", "replayed", "message"}
    GET /weights/update?idempotency_key=k -> {"status": "done", "result"} | {"status": "running"} | 404

Rollback: a failure in any phase leaves nothing staged live (discarded on every replica), the
version unchanged, and generation resumed if this call paused it; a pause the caller made
before stays (the caller resumes it, as it would after its other updates). The error is the
usual JSON plus "phase" (pause | receive | stage | swap | clear_cache | resume: where it stopped)
and "weight_version" (the version live now). Status: 4xx for what the caller sent, found before
anything changed (400: names, shapes, dtypes, a path or handles that do not hold a checkpoint;
404: lora_name; 409: engine state (asleep, no group) or a version that does not increase; 422:
idempotency_key reused with another body); 504 past deadline_s (in any phase); 500
weight_transfer_error for a transport failure (the trainer's group broke: a peer died, or did
not answer within the group's timeout); 503 engine dead. A failure after the swap (phase
"resume": the new weights are live, generation could not be resumed) names the new version.

deadline_s bounds the whole call: the wait for the control lock, the pause (mode "wait" drains),
and the receive as a whole: every collective of a push gets what is left of the deadline as its
timeout, so a trainer that trickles buckets cannot hold generation paused past it (the group's
timeout only bounds each bucket). Past it over a group the engine's workers abort the group, so
the trainer's sender fails at once; the server goes on serving the old weights and a new
/init_weight_transfer_engine forms a new group, no restart needed.

Concurrency: the call holds the control lock from the receive to the resume, so a second
/weights/update, /pause, /resume, /sleep or /scale waits for it (a second update within its own
deadline_s), and nothing lifts this call's pause halfway. Idempotency: rollout/api/idempotency.py
(a failed update is forgotten, its key may be retried; every API server knows every key).
"""
import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field, model_validator

from engine.core.engine_core import stale_version
from engine.process.utility import UpdateTrace
from engine.timeouts import wait_within
from rollout.api.control import call
from rollout.api.errors import APIError, engine_error
from rollout.api.protocol import UpdateInfo, _Strict, check_absolute
from rollout.api.state import ServerState, get_state
from rollout.api.weights import _loaded_lora
from rollout.log import log

router = APIRouter(tags=["admin"])

MIN_DEADLINE_S, MAX_DEADLINE_S = 1.0, 86400.0  # under a second no pause-push-resume can finish
BACKSTOP_S = 10.0  # past the deadline, how long the engine may take to honour it before the call answers anyway
GROUP_SOURCES = ("gloo", "nccl")
ENGINE_SOURCE = {"gloo": "broadcast", "nccl": "broadcast", "disk": "disk", "ipc": "ipc"}
SOURCE_FIELD = {"gloo": "update_info", "nccl": "update_info", "disk": "path", "ipc": "handles"}


class WeightsUpdateBody(_Strict):
    source: Literal["gloo", "nccl", "disk", "ipc"]
    update_info: UpdateInfo | None = None
    path: str | None = None
    handles: dict | None = None
    version: int | None = None
    lora_name: str | None = None
    pause_mode: Literal["abort", "wait", "keep"] = "keep"
    recompute_kv: bool = False
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)
    deadline_s: float | None = Field(None, ge=MIN_DEADLINE_S, le=MAX_DEADLINE_S)

    @model_validator(mode="after")
    def _fields_fit_the_source(self):
        wants = SOURCE_FIELD[self.source]
        for name in ("update_info", "path", "handles"):
            beside = self.source in GROUP_SOURCES and name == "handles"  # (some replicas read shared memory)
            if name != wants and not beside and getattr(self, name) is not None:
                raise APIError(400, f"{name} does not go with source {self.source!r} (it takes {wants})", name)
        if self.source not in GROUP_SOURCES and getattr(self, wants) is None:
            raise APIError(400, f"source {self.source!r} needs {wants}", wants)
        if self.source in GROUP_SOURCES and self.handles is not None and not isinstance(self.handles.get("replicas"),
                                                                                          list):
            raise APIError(400, 'handles beside a group push name replicas: {"replicas": [handles, each with its '
                                '"replica"]}', "handles")
        if self.path is not None:
            check_absolute(self.path, "path")
        if self.recompute_kv and self.pause_mode != "keep":
            raise APIError(400, "recompute_kv goes with pause_mode 'keep' (other modes keep no request)",
                           "recompute_kv")
        info = self.update_info
        if info is not None:
            for name, top in (("weight_version", "version"), ("lora_name", "lora_name")):
                if getattr(info, name) is not None:
                    raise APIError(400, f"give update_info.{name} as {top} here", f"update_info.{name}")
        return self

    def fingerprint(self) -> str:
        """What makes two calls the same update: the body but its key and deadline (a retry may
        allow itself another deadline), and of IPC handles the tensor names (a retry shares the
        tensors again, under new segment names or a new lease of the spare, or the other way;
        beside a group push they only say where some replicas read the tensors update_info names)."""
        body = self.model_dump(exclude={"idempotency_key", "deadline_s"})
        if self.source in GROUP_SOURCES:
            body["handles"] = None
        elif self.handles is not None:
            parts = self.handles.get("replicas")  # (every replica's spare written: the same tensors in each)
            first = parts[0] if isinstance(parts, list) and parts and isinstance(parts[0], dict) else self.handles
            tensors = first.get("tensors")
            body["handles"] = [t.get("name") if isinstance(t, dict) else t for t in tensors] \
                if isinstance(tensors, list) else None
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


@router.post("/weights/update")
async def weights_update(body: WeightsUpdateBody, request: Request):
    state = get_state(request)
    started = time.monotonic()
    answer, replayed = await state.weight_updates.run(
        body.idempotency_key, body.fingerprint(), lambda: Transaction(state, body, started).run())
    return dict(answer, replayed=True) if replayed else answer


@router.get("/weights/update")
async def weights_update_status(request: Request, idempotency_key: str = Query(min_length=1, max_length=200)):
    """Whether the update with this key is done (its answer) or running (through any API server);
    404 for a key never seen, failed, or forgotten."""
    known = get_state(request).weight_updates.status(idempotency_key)
    if known is None:
        raise APIError(404, f"no /weights/update with idempotency_key {idempotency_key!r} is running or remembered "
                            "(a failed one is forgotten)", "idempotency_key")
    status, answer = known
    return {"idempotency_key": idempotency_key, "status": status, **({"result": answer} if answer else {})}


class Transaction:
    """One /weights/update: `phase` is where it is (where it stopped, once it failed)."""

    def __init__(self, state: ServerState, body: WeightsUpdateBody, started: float):
        self.state, self.body, self.started = state, body, started
        self.deadline = None if body.deadline_s is None else started + body.deadline_s
        self.param = SOURCE_FIELD[body.source]
        self.phase = "pause"
        self.phases: dict[str, float] = {}
        self.paused_here = False
        self.lora_id = 0
        self.version_before: int | None = None
        self.lock_handed_off = False  # a late rollback releases the control lock (see _receive)
        self.group_closed = False

    async def run(self) -> dict:
        await self._check_input()  # 4xx before anything changes
        lock = self.state.control_lock
        t0 = time.monotonic()
        try:
            await self._within(lock.acquire(), "waiting for the control lock (another control call was running)")
            self.phases["queue"] = time.monotonic() - t0
        except BaseException as e:
            if self.body.source in GROUP_SOURCES:
                await self._release_sender()
            raise await self._failure(e) from e
        try:
            return await self._locked()
        finally:
            if not self.lock_handed_off:
                lock.release()

    async def _check_input(self) -> None:
        body, engine = self.body, self.state.engine
        if body.source == "nccl" and not str(engine.config.device).startswith("cuda"):
            raise APIError(400, f"source 'nccl' needs the engine on a CUDA device; this engine runs on "
                                f"{engine.config.device}: use 'gloo'", "source")
        if body.path is not None and not Path(body.path).is_dir():
            raise APIError(400, f"path {body.path!r} is not a folder on the server", "path")
        self.lora_id = await _loaded_lora(self.state, body.lora_name, "lora_name")

    async def _locked(self) -> dict:
        body, engine = self.body, self.state.engine
        try:
            # Over a group the trainer is already sending: a stale version is refused after the push
            # is received (weight_update_plan), so that its sender is not left blocked.
            if body.source not in GROUP_SOURCES and body.version is not None:
                self.version_before = await call(engine.get_weight_version(self.lora_id))
                refusal = stale_version(body.version, self.version_before)
                if refusal is not None:
                    self.phase = "stage"
                    raise refusal
            self.phase = "receive"
            result = await self._receive()
            self.phase, t1 = "resume", time.monotonic()
            resumed = await call(engine.resume_generation()) if self.paused_here else {}
            self.phases["resume"] = time.monotonic() - t1
        except BaseException as e:
            await self._rollback()
            if self.phase == "pause" and "receive" not in self.phases and body.source in GROUP_SOURCES:
                await self._release_sender()
            raise await self._failure(e) from e
        return self._answer(result, result["paused"], resumed)

    async def _release_sender(self) -> None:
        """The trainer's sender is blocked on a push this call will never receive: close the
        engine's side of the group, so that it fails at once (a new group is needed either way)."""
        try:
            await self.state.engine.close_weight_transfer()
            self.group_closed = True
        except Exception as e:  # noqa: BLE001 - the update's own error is the one to answer
            log(f"closing the weight transfer group after a failed update failed: {e}")

    async def _receive(self) -> dict:
        """Receive, stage, pause, swap, clear caches (AsyncLLM.update_weights_from, one plan on
        every replica). The pause is the plan's too: where the engine receives beside its steps,
        generation pauses only once every replica staged, for the swap; elsewhere before the
        receive. The engine honours the deadline itself, waited for here BACKSTOP_S longer."""
        body, engine = self.body, self.state.engine
        left = None if self.deadline is None else self.deadline - time.monotonic()
        if left is not None and left <= 0:
            self.phase = "pause"
            raise TimeoutError(f"deadline_s ({body.deadline_s:g} s) passed while waiting for the control lock")
        args = [body.path] if body.source == "disk" else [] if body.handles is None else [body.handles]
        trace = UpdateTrace()
        pause = {"mode": body.pause_mode, "recompute_kv": body.recompute_kv}
        update = asyncio.ensure_future(engine.update_weights_from(ENGINE_SOURCE[body.source], args, body.version,
                                                                  self.lora_id, deadline_s=left, trace=trace,
                                                                  pause=pause))
        backstop = None if left is None else time.monotonic() + left + BACKSTOP_S
        try:
            while True:
                wait = None if backstop is None else max(backstop - time.monotonic(), 0.0)
                done, _ = await asyncio.wait({update}, timeout=wait)
                if done:
                    result = update.result()
                    break
                if trace.phase in ("swap", "done"):  # a swap that started is never abandoned halfway
                    backstop = None
                    continue
                update.cancel()
                self.phase = trace.phase or "receive"
                self._note_pause(trace, asked=self.phase == "pause")
                self._late_rollback(trace.update_id)
                raise TimeoutError(f"deadline_s ({body.deadline_s:g} s) passed in phase {self.phase!r} and the "
                                   f"engine did not give up within {BACKSTOP_S:g} s more; nothing goes live")
        except BaseException:
            self.phase = trace.phase if trace.phase not in ("", "done") else "receive"
            self._note_pause(trace)
            self.phases.update(trace.seconds)
            raise
        self._note_pause(trace)
        self.phases.update(trace.seconds)
        return result

    def _note_pause(self, trace: UpdateTrace, asked: bool = False) -> None:
        """Whether generation is paused by this call (so its resume is this call's): the update's
        pause answered that it paused, or (`asked`) its pause was cut off unanswered."""
        self.paused_here = self.paused_here or asked or trace.paused_here

    def _late_rollback(self, update_id: str) -> None:
        """The engine is still staging (its call outlived the deadline): once it is done, drop what
        it staged and resume, holding the control lock until then so that no other update lands
        in between."""
        engine, lock = self.state.engine, self.state.control_lock
        paused_here, self.paused_here = self.paused_here, False  # (resumed there, not by _rollback)
        self.lock_handed_off = True

        async def rollback():
            try:
                await engine.discard_weights(update_id)
                if paused_here:
                    await engine.resume_generation()
            except Exception as e:  # noqa: BLE001 - logged: the caller has had its answer
                log(f"rolling back a weight update past its deadline failed: {e}")
            finally:
                lock.release()

        asyncio.ensure_future(rollback())

    async def _rollback(self) -> None:
        """Generation resumes if this call paused it (a failure after the pause, or in the pause
        itself: a "wait" pause that ran out of time is still in place). Nothing staged is live:
        weight_update_plan discarded it."""
        if not self.paused_here or self.phase == "resume":
            return
        try:
            await self.state.engine.resume_generation()
        except Exception as e:  # noqa: BLE001 - the update's own error is the one to answer
            log(f"resuming generation after a failed weight update failed: {e}")

    async def _failure(self, e: BaseException) -> APIError:
        """The error answer: the engine's status for `e`, the phase, the version live now."""
        if isinstance(e, asyncio.CancelledError):
            raise e
        err = engine_error(e, self.param)
        try:
            live = await wait_within(self.state.engine.get_weight_version(self.lora_id), 5.0)
        except Exception:  # noqa: BLE001 - a dead engine: what was live before
            live = self.version_before
        if self.phase == "resume":
            outcome = f"the new weights are live (version {live}) but generation could not be resumed"
        else:
            outcome = f"nothing changed: version {live} stays live" + (
                ", generation resumed" if self.paused_here else "") + (
                "; the weight transfer group was closed (the sender was waiting): init it again"
                if self.group_closed else "")
        log(f"weight update ({self.body.source}) failed in phase {self.phase}: {err.message}")
        return APIError(err.status, f"weight update failed in phase {self.phase!r} ({outcome}): {err.message}",
                        err.param, err.type, extra={"phase": self.phase, "weight_version": live})

    async def _within(self, awaitable, what: str):
        """Await, but no longer than the deadline: TimeoutError naming `what` past it."""
        if self.deadline is None:
            return await awaitable
        try:
            return await wait_within(awaitable, max(self.deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise TimeoutError(f"deadline_s ({self.body.deadline_s:g} s) passed while {what}") from None

    def _answer(self, result: dict, paused: dict, resumed: dict) -> dict:
        body, state = self.body, self.state
        seconds = time.monotonic() - self.started
        label = ("lora_" if body.lora_name else "") + ENGINE_SOURCE[body.source]
        state.metrics.observe_push(label, seconds)
        if self.paused_here:
            state.metrics.pause_call_seconds.observe(self.phases["pause"])
            state.metrics.observe_pause(resumed.get("paused_seconds"))
        phases = ", ".join(f"{k} {v:.3f}" for k, v in self.phases.items())
        what = f"LoRA adapter {body.lora_name!r}" if body.lora_name else "weights"
        log(f"{what} version {result['weight_version']} in place via /weights/update ({body.source}, "
            f"{seconds:.2f} s: {phases})")
        stats = {k: result[k] for k in ("num_tensors", "num_bytes") if k in result}
        return {"message": "Weights updated", "weight_version": result["weight_version"], "source": body.source,
                "phases": self.phases, "seconds": seconds, **stats,
                "aborted": paused.get("aborted", 0), "kept": paused.get("kept", 0), "paused_here": self.paused_here,
                "paused_seconds": resumed.get("paused_seconds"), "idempotency_key": body.idempotency_key,
                "replayed": False, **({"lora_name": body.lora_name} if body.lora_name else {})}
