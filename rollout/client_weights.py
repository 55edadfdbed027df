"""The trainer's side of weight pushes: `client.weights`, one `WeightTransfer` per client, written
once for RolloutClient and AsyncRolloutClient.

    push_weights:        [POST /weights/update {source: gloo|nccl} || WeightSender.send]
                         (the server receives while it generates, then pauses, swaps, clears caches
                         and resumes in that call);
                         to a CPU server on this machine: push_weights_shared's route instead; to
                         one with some replicas here: their spares written, the rest over the group
    push_weights_shared: POST /weights/spare -> SpareWriter.write -> POST /weights/update {source: ipc}
                         (the tensors written straight into the server's staging memory while it
                         generates; where it lends none: SharedWeights.share, a segment of ours)
    weight_update():     vLLM's phases, for an update in chunks: pause(mode) -> start ->
                         [POST /update_weights || WeightSender.send]... -> finish(version) -> resume

Every protocol here is a plan: a generator that yields steps and receives their results. A step
is a function of the client (`lambda c: c.pause(mode)`: the sync client returns the answer, the
async one a coroutine) or a `Beside` (an HTTP call and a blocking function run concurrently,
such as the server's /update_weights beside the trainer's WeightSender.send). `run_plan` and
`arun_plan` execute plans; nothing else differs between the two clients.

The trainer is rank 0 of a `weight_sync.WeightTransferGroup`; the engine's workers are ranks
1..N. Forming the group blocks until every rank joined, so the trainer's side and the server's
/init_weight_transfer_engine run beside each other; likewise each push's `WeightSender.send` and
the server's /weights/update (or /update_weights). If the HTTP side fails and the sender is still
blocked ABORT_AFTER_S later, the group is aborted so the sender fails now instead of at its
timeout; the group is broken then (as after any transport failure, or a push past its
deadline_s): call init_weight_transfer() again. A push the engine refuses (names, shapes, dtypes,
a version that does not increase) leaves the group usable.

Retries: with an `idempotency_key`, a push the server already made (its answer lost with a
dropped connection) is answered from the server's memory of that key, without sending a byte
(push_weights asks GET /weights/update?idempotency_key= first; the other routes just resend,
and the server replays); one still running is waited for.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable

from rollout.errors import RolloutAPIError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
ABORT_AFTER_S = 5.0  # after the server failed an update, how long the sender may take to notice
# the sender's own deadline is the server's plus this much: the server gives up first, answers
# with the phase, and aborts the group (so the sender fails at once); the sender's deadline only
# matters when the server never started receiving
SENDER_DEADLINE_GRACE_S = 2.0
Plan = Generator[Any, Any, Any]


@dataclass
class Beside:
    """Run `http(client)` and the blocking `work()` concurrently. If the HTTP call fails and the
    work is still running `grace_s` later, `on_stuck(error)` is called (to break a blocked
    collective). The step's result is a `Both`."""

    http: Callable
    work: Callable[[], Any]
    grace_s: float = ABORT_AFTER_S
    on_stuck: Callable[[BaseException], None] | None = None


@dataclass
class Both:
    result: Any = None
    error: BaseException | None = None
    work_result: Any = None
    work_error: BaseException | None = None


def run_plan(client, plan: Plan):
    """Execute a plan with a blocking client; returns the plan's return value."""
    value, error = None, None
    while True:
        try:
            step = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            value = _beside(client, step) if isinstance(step, Beside) else step(client)
        except Exception as e:  # handed to the plan, which may clean up (resume) and re-raise
            error = e


def _beside(client, step: Beside) -> Both:
    both = Both()
    thread = threading.Thread(target=_capture, args=(both, step.work), name="beside-http", daemon=True)
    thread.start()
    try:
        both.result = step.http(client)
    except Exception as e:
        both.error = e
        thread.join(step.grace_s)
        if thread.is_alive() and step.on_stuck is not None:
            step.on_stuck(e)
    thread.join()
    return both


def _capture(both: Both, work: Callable[[], Any]) -> None:
    try:
        both.work_result = work()
    except BaseException as e:  # noqa: BLE001 - handed to the plan
        both.work_error = e


async def arun_plan(client, plan: Plan):
    """Execute a plan with an asyncio client; returns the plan's return value."""
    value, error = None, None
    while True:
        try:
            step = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            value = await (_abeside(client, step) if isinstance(step, Beside) else step(client))
        except Exception as e:
            error = e


async def _abeside(client, step: Beside) -> Both:
    both = Both()
    work = asyncio.ensure_future(asyncio.to_thread(_capture, both, step.work))
    try:
        both.result = await step.http(client)
    except Exception as e:
        both.error = e
        done, _ = await asyncio.wait({work}, timeout=step.grace_s)
        if not done and step.on_stuck is not None:
            step.on_stuck(e)
    await work
    return both


def _pause(mode: str, recompute_kv: bool) -> dict:
    """The pause a push makes: client.pause(**this)."""
    return {"mode": mode, "recompute_kv": recompute_kv} if recompute_kv else {"mode": mode}


def log_push(wandb_run: Any, source: str, seconds: float, num_bytes: int | None, version: int | None) -> None:
    """Log one push to the trainer's W&B run (`True`: the current `wandb.run`). commit=False: the
    values join the trainer's next `log` call instead of advancing its step."""
    if wandb_run is True:
        import wandb

        wandb_run = wandb.run
    if wandb_run is None or wandb_run is False:
        return
    data = {"rollout/push_seconds": seconds, f"rollout/push_{source}_seconds": seconds}
    if num_bytes:
        data["rollout/push_gb_per_s"] = num_bytes / max(seconds, 1e-9) / 1e9
    if version is not None:
        data["rollout/weight_version"] = version
    try:
        wandb_run.log(data, commit=False)
    except Exception as e:  # noqa: BLE001 - metrics must never fail a push
        logger.warning("logging the push to W&B failed: %s", e)


def _update_info(named: list, dtype, version: int | None) -> dict:
    def dname(t):
        d = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return str(d).removeprefix("torch.")

    return {"names": [n for n, _ in named], "dtype_names": [dname(t) for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "packed": True, "weight_version": version}


class WeightUpdate:
    """One update in progress (see WeightTransfer.update); `send` pushes one chunk of named
    tensors (awaitable with the async client)."""

    def __init__(self, transfer: WeightTransfer, group, dtype):
        self.transfer, self.group, self.dtype = transfer, group, dtype
        self.version: int | None = None
        self.weight_version: int | None = None
        self.stats: list[dict] = []
        self.paused: dict = {}  # the pause's answer: how many requests it aborted and kept
        self.paused_seconds: float | None = None  # how long generation stood still (the resume's answer)
        self.t0 = time.perf_counter()

    def send(self, named_tensors: Iterable):
        return self.transfer.run(self.transfer._send_plan(self, named_tensors))

    @property
    def num_sends(self) -> int:
        return len(self.stats)

    def result(self) -> dict:
        last = self.stats[-1] if self.stats else {}
        return {"weight_version": self.weight_version, "seconds": time.perf_counter() - self.t0,
                "send": last.get("send"), "update": last.get("update"), "num_sends": self.num_sends,
                "aborted": self.paused.get("aborted", 0), "kept": self.paused.get("kept", 0),
                "paused_seconds": self.paused_seconds}


class WeightTransfer:
    """The trainer's weight-transfer state for one client (`client.weights`): the group, the
    wire dtype, the bucket size. Its methods return results (blocking client) or coroutines
    (asyncio client)."""

    def __init__(self, client, is_async: bool):
        self.client, self.is_async = client, is_async
        self.group = None  # weight_sync.WeightTransferGroup, rank 0
        self.dtype = None  # the engine's dtype: pushed floating-point tensors are cast to it
        self.bucket_bytes: int | None = None
        self.local = False  # push() goes through shared memory: the server is a CPU one on this machine
        self.beside: list[int] = []  # its replicas on this machine (the others not): written, not in the group
        self.shared = None  # weight_sync.SharedWeights of push_shared: its segment is reused push after push
        self._sharing = threading.Lock()  # held while a push reads self.shared or writes self.spare
        # held from a group push's POST to its last byte: the server receives one update at a time,
        # and each must get its own sender's bytes (two at once would mix, under each one's version)
        self._group_turn = asyncio.Lock() if is_async else threading.Lock()
        self.spare: dict[int, Any] = {}  # replica -> weight_sync.SpareWriter: its staging memory, mapped
        self._spare_lent = True  # False once the server said it lends none (CUDA, ...)
        self.holder = uuid.uuid4().hex  # who leases the server's spare
        self._sender_cache = None  # the last WeightSender (its bucket buffers are reused) and its (group, bucket size)

    def _sender(self, group):
        from weight_sync import WeightSender

        key = (group, self.bucket_bytes)
        if self._sender_cache is None or self._sender_cache[0] != key:
            sender = WeightSender(group, **({"bucket_bytes": self.bucket_bytes} if self.bucket_bytes else {}))
            self._sender_cache = (key, sender)
        return self._sender_cache[1]

    def run(self, plan: Plan):
        return arun_plan(self.client, plan) if self.is_async else run_plan(self.client, plan)

    # ---- the group ----------------------------------------------------------------------------
    def init(self, backend: str = "gloo", master_address: str = "127.0.0.1", master_port: int | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, bucket_bytes: int | None = None,
             shared_memory_when_local: bool = True):
        """Form the transfer group: this process is rank 0 (it hosts the rendezvous on
        master_address:master_port, a free port by default), the server's workers join.

        `shared_memory_when_local`: when the server runs on the CPU of this machine (its
        /server_info `shm_host` is this process's `weight_sync.host_key()`: one kernel, one
        /dev/shm), push() of CPU tensors takes push_shared's route (the server's leased spare, or
        a segment) instead of the group: loopback TCP moves a few GB/s where shared memory moves
        tens. Its result's `transport` says which ("spare", "segment" or "group"). The group is
        formed either way (update() in chunks uses it); False keeps every push on it. Where only
        some of its CPU replicas run here (`replica_hosts`), the group is formed from the others
        and each push writes the tensors into these replicas' spares (a segment where they lend
        none) beside the broadcast to the rest, one update for all (transport "group+spare" or
        "group+segment"; update() in chunks is refused then)."""
        return self.run(self._init_plan(backend, master_address, master_port, timeout_s, bucket_bytes,
                                        shared_memory_when_local))

    def _init_plan(self, backend, master_address, master_port, timeout_s, bucket_bytes,
                   shared_memory_when_local: bool) -> Plan:
        from weight_sync import WeightTransferGroup, find_free_port, host_key

        yield from self._close_plan(keep_memory=True)
        info = yield lambda c: c.server_info()
        here = host_key()
        cpu_here = shared_memory_when_local and info.get("device") == "cpu" and here is not None
        hosts = {int(r): k for r, k in (info.get("replica_hosts") or {}).items()}
        beside = sorted(r for r, k in hosts.items() if k == here) if cpu_here else []
        others = sorted(set(hosts) - set(beside))
        if not (beside and others):
            beside = []
        ranks = len(others) * info.get("tensor_parallel_size", 1) if beside else (yield lambda c: c.get_world_size())
        world_size = ranks + 1
        port = master_port or find_free_port(master_address)
        init_info = dict(master_address=master_address, master_port=port, world_size=world_size, rank_offset=1,
                         backend=backend, timeout_s=timeout_s, **({"replicas": others} if beside else {}))
        form = functools.partial(WeightTransferGroup, master_address, port, 0, world_size, backend=backend,
                                 timeout_s=timeout_s)
        both = yield Beside(lambda c: c.init_weight_transfer_engine(init_info), form)
        if both.error is not None:  # the server's reason is the useful one
            if both.work_result is not None:
                both.work_result.close()
            raise both.error
        if both.work_error is not None:
            raise both.work_error
        import torch

        self.group, self.bucket_bytes, self.beside = both.work_result, bucket_bytes, beside
        self.dtype = getattr(torch, info["dtype"]) if info.get("dtype") else None
        self.local = cpu_here and info.get("shm_host") == here
        return both.result

    def close(self):
        """Close the trainer's side of the group (and the server's, if it is reachable)."""
        return self.run(self._close_plan())

    def _close_plan(self, keep_memory: bool = False) -> Plan:
        """`keep_memory` (a new group replaces this one): the segment and the spares' mappings stay,
        whose pages a remap would fault in again (~0.2 s for two replicas of the default model)."""
        if not keep_memory:
            if self.shared is not None:
                self.shared.close()
            for writer in self.spare.values():
                writer.close()
            self.spare = {}
        group, self.group, self._sender_cache, self.local, self.beside = self.group, None, None, False, []
        if group is None:
            return
        try:
            yield lambda c: c.close_weight_transfer_engine()
        except Exception:  # noqa: BLE001 - best effort: the server may be gone
            pass
        group.close()

    # ---- pushes -------------------------------------------------------------------------------
    def push(self, named_tensors: Iterable, version: int | None = None, pause_mode: str = "keep", dtype=None,
             recompute_kv: bool = False, lora_name: str | None = None, idempotency_key: str | None = None,
             deadline_s: float | None = None):
        """[POST /weights/update || WeightSender.send]: in that one call the server pauses (mode),
        receives, swaps atomically, clears its prefix and encoder caches, labels the weights
        `version` (default: previous + 1; versions must increase) and resumes.

        Tensors carry Hugging Face names (a subset of the model is fine) and are cast to the
        engine's dtype (or `dtype`). A failed push leaves the old weights serving, whole, and
        generation resumed (unless the trainer had paused it: then it stays paused); the
        RolloutAPIError names the `phase` that failed. In chunks: `update()`.

        pause_mode "keep" (the default) loses no work: requests in flight freeze and continue on
        the new weights (their later tokens carry the new version); "abort" ends them with
        finish_reason "abort" and partial tokens; "wait" lets them finish first. The result says
        how many were aborted and kept. `recompute_kv`: kept requests recompute their KV under the
        new weights instead of reusing the old weights' KV (see RolloutClient.pause).

        `lora_name`: the tensors are that LoRA adapter's (loaded on the server; PEFT names as
        `peft_model.named_parameters()` gives them, a subset is fine), `version` the adapter's
        own (default +1); only that adapter's outputs change, its tokens carry the version in
        `lora_versions`.

        `idempotency_key`: a retry with the same key (after a dropped connection) gets the first
        push's result without sending again. `deadline_s`: the whole push, pause to resume, or
        it fails (504, phase named) and the group is broken: init_weight_transfer() again.

        To a CPU server on this machine the tensors go through shared memory, not the group
        (init's `shared_memory_when_local`), and to the replicas on this machine of one that has
        some elsewhere too (the rest get the broadcast); the result's `transport` says which way
        they went: "group", "spare", "segment", "group+spare" or "group+segment"."""
        return self.run(self._push_plan(named_tensors, version, pause_mode, recompute_kv, dtype, lora_name,
                                        idempotency_key, deadline_s))

    def _push_plan(self, named_tensors, version, pause_mode: str, recompute_kv: bool, dtype, lora_name: str | None,
                   idempotency_key: str | None, deadline_s: float | None) -> Plan:
        if self.group is None:
            raise RuntimeError("no weight transfer group: call init_weight_transfer() first")
        # (the server would refuse these before receiving, leaving the sender blocked: refused here)
        if pause_mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause_mode must be 'abort', 'wait' or 'keep', got {pause_mode!r}")
        if recompute_kv and pause_mode != "keep":
            raise ValueError("recompute_kv goes with pause_mode 'keep' (other modes keep no request)")
        t0 = time.perf_counter()
        group, dtype = self.group, dtype or self.dtype
        named = [(n, t) for n, t in named_tensors]
        if lora_name is not None:
            from engine.worker.lora import peft_key

            named = [(peft_key(n), t) for n, t in named]
        if self.local and all(t.device.type == "cpu" for _, t in named):
            answer = yield from self._shared_plan(named, version, pause_mode, recompute_kv, lora_name, dtype,
                                                  idempotency_key, deadline_s)
            return dict(_push_result(answer, None, t0), transport=answer["shared_via"])
        info = _update_info(named, dtype, None)
        del info["weight_version"]  # /weights/update takes it as `version`
        fields = dict(update_info=info, version=version, lora_name=lora_name, pause_mode=pause_mode,
                      recompute_kv=recompute_kv)
        transport, done = "group", None

        def post(c):
            return c.weights_update(group.backend, idempotency_key, deadline_s, **fields)

        if idempotency_key is not None:  # a retry of a push the server made or is making: no byte moves
            replayed = yield from self._replay_plan(idempotency_key, post)
            if replayed is not None:
                return dict(_push_result(replayed, None, t0), transport="group")
        yield from self._refuse_early_plan(version, lora_name)
        sender = self._sender(group)

        def send() -> dict:
            with group.deadline(None if deadline_s is None else deadline_s + SENDER_DEADLINE_GRACE_S):
                return sender.send(named, dtype)

        yield lambda c: self._group_turn.acquire()
        try:
            if self.beside:  # (before the pause: those replicas generate while their part is written)
                fields["handles"], done = yield from self._beside_plan(named, dtype, lora_name)
                transport = "group+spare" if fields["handles"].get("kind") == "spare" else "group+segment"
            both = yield Beside(post, send, on_stuck=lambda e: group.abort(f"the server failed the update: {e}"))
        finally:
            if done is not None:
                done()
            self._group_turn.release()
        if both.error is not None:  # the server's answer names the phase; a refused push ends the sender too
            raise both.error
        if both.work_error is not None:
            raise both.work_error
        result = dict(_push_result(both.result, both.work_result, t0), transport=transport)
        log_push(self.client.wandb_run, "broadcast", result["seconds"], both.work_result["num_bytes"],
                 result["weight_version"] if lora_name is None else None)
        return result

    def _replay_plan(self, idempotency_key: str, post) -> Plan:
        """The server's answer to an earlier push with this key (waiting for it if it runs), or
        None when the server does not know the key (never made, failed, or forgotten)."""
        try:
            known = yield lambda c: c.weights_update_status(idempotency_key)
        except RolloutAPIError as e:
            if e.status != 404:
                raise
            return None
        if known["status"] == "done":
            return dict(known["result"], replayed=True)
        return (yield post)  # running: the server answers this call with that push's answer

    def _refuse_early_plan(self, version: int | None, lora_name: str | None) -> Plan:
        """Refuse before any byte moves what the server would refuse before receiving (the
        sender would block on a receiver that never came) or after (the push would be wasted)."""
        if lora_name is not None:
            models = yield lambda c: c.model_info()
            if lora_name not in [m["id"] for m in models[1:]]:
                raise RolloutAPIError(404, f"the LoRA adapter {lora_name!r} is not loaded on the server",
                                      "not_found_error", "lora_name")
        elif version is not None:
            _check_increases(version, (yield lambda c: c.weight_version()))

    def update(self, version: int | None = None, pause_mode: str = "keep", dtype=None, recompute_kv: bool = False):
        """with client.weight_update(version=step) as u: u.send(chunk); u.send(chunk2) ...
        (async with ... and await u.send(...) with the asyncio client)

        One update in several pushes (e.g. layer by layer, to bound the trainer's memory): pause
        and start on entry, finish(version) and resume on exit (resume only, after an error).
        Every chunk is swapped in atomically on arrival; generation stays paused in between."""
        return (self._async_update if self.is_async else self._sync_update)(
            version, _pause(pause_mode, recompute_kv), dtype)

    @contextlib.contextmanager
    def _sync_update(self, version, pause: dict, dtype):
        update = self.run(self._begin_plan(version, pause, dtype))
        ok = False
        try:
            yield update
            ok = True
        finally:
            self.run(self._end_plan(update, ok))

    @contextlib.asynccontextmanager
    async def _async_update(self, version, pause: dict, dtype):
        update = await self.run(self._begin_plan(version, pause, dtype))
        ok = False
        try:
            yield update
            ok = True
        finally:
            await self.run(self._end_plan(update, ok))

    def _begin_plan(self, version, pause: dict, dtype) -> Plan:
        if self.group is None:
            raise RuntimeError("no weight transfer group: call init_weight_transfer() first")
        if self.beside:
            raise RuntimeError(f"an update in chunks goes over the group, which the server's replicas {self.beside} "
                               "(on this machine: push() writes theirs) are not in; push() the whole update, or "
                               "init_weight_transfer(shared_memory_when_local=False) to put every replica in it")
        update = WeightUpdate(self, self.group, dtype or self.dtype)
        update.paused = yield lambda c: c.pause(**pause)
        try:
            live = yield lambda c: c.weight_version()
            if version is not None:  # refused before any byte moves
                _check_increases(version, live)
            update.version = live + 1 if version is None else version
            yield lambda c: c.start_weight_update()
        except BaseException:
            yield lambda c: c.resume()
            raise
        return update

    def _send_plan(self, update: WeightUpdate, named_tensors: Iterable) -> Plan:
        named = [(n, t) for n, t in named_tensors]
        sender = self._sender(update.group)
        info = _update_info(named, update.dtype, None)  # the version is set once, by the finish
        yield lambda c: self._group_turn.acquire()
        try:
            both = yield Beside(lambda c: c.update_weights(info), functools.partial(sender.send, named, update.dtype),
                                on_stuck=lambda e: update.group.abort(f"the server failed the update: {e}"))
        finally:
            self._group_turn.release()
        if both.error is not None:  # a refused push ends the sender too, with the group intact
            raise both.error
        if both.work_error is not None:
            raise both.work_error
        update.stats.append({"send": both.work_result, "update": both.result})
        return update.stats[-1]

    def _end_plan(self, update: WeightUpdate, ok: bool) -> Plan:
        try:
            if ok and update.stats:
                update.weight_version = yield lambda c: c.finish_weight_update(update.version)
        finally:
            resumed = yield lambda c: c.resume()
            update.paused_seconds = (resumed or {}).get("paused_seconds")
        if update.stats:
            log_push(self.client.wandb_run, "broadcast", time.perf_counter() - update.t0,
                     sum(s["send"]["num_bytes"] for s in update.stats), update.weight_version)

    def push_shared(self, named_tensors: Iterable, version: int | None = None, pause_mode: str = "keep",
                    recompute_kv: bool = False, lora_name: str | None = None, dtype=None,
                    idempotency_key: str | None = None, deadline_s: float | None = None):
        """For a trainer on the server's machine: CPU tensors are written straight into the
        memory the server stages updates in (leased, POST /weights/spare; one copy, made while it
        generates), else shared (CUDA IPC on a shared GPU, a shared-memory segment of ours) ->
        POST /weights/update {source: ipc}: the server pauses, takes them in (swaps the spare in,
        or copies), clears caches and resumes in that call. No transfer group needed.
        Floating-point tensors are cast to `dtype`, by default the engine's (as push does; learned
        from /server_info when no group told it). `lora_name`, `idempotency_key`, `deadline_s`:
        see push (a retry shares the tensors again; the server answers it from its memory)."""
        return self.run(self._shared_plan(named_tensors, version, pause_mode, recompute_kv, lora_name, dtype,
                                          idempotency_key, deadline_s))

    def _shared_plan(self, named_tensors, version, pause_mode: str, recompute_kv: bool, lora_name: str | None,
                     dtype, idempotency_key: str | None, deadline_s: float | None) -> Plan:
        from weight_sync import SharedWeights

        t0 = time.perf_counter()
        named = list(named_tensors)  # (read twice where the spare does not take them)
        own = self._sharing.acquire(blocking=False)  # a concurrent push gets a segment of its own
        if own and self.shared is None:
            self.shared = SharedWeights()
        shared = self.shared if own else SharedWeights()
        try:
            # (the spare's lease names the engine's dtype, which the writer casts to)
            handles = (yield from self._write_spare(named, dtype)) if own and lora_name is None else None
            via = "spare" if handles is not None else "segment"
            if handles is None:
                if dtype is None and self.dtype is None:
                    import torch

                    served = (yield lambda c: c.server_info()).get("dtype")
                    dtype = getattr(torch, served) if served else None
                handles = shared.share(named, dtype or self.dtype)
            result = yield lambda c: c.weights_update("ipc", idempotency_key, deadline_s, handles=handles,
                                                      version=version, lora_name=lora_name, pause_mode=pause_mode,
                                                      recompute_kv=recompute_kv)
        except BaseException:  # the server may still be reading the segment: the next push shares a new one
            shared.close()
            raise
        finally:
            if own:
                self._sharing.release()
            else:
                shared.close()
        log_push(self.client.wandb_run, "ipc", time.perf_counter() - t0, result.get("num_bytes"),
                 result.get("weight_version") if lora_name is None else None)
        return dict(result, shared_via=via)

    def _beside_plan(self, named: list, dtype, lora_name: str | None) -> Plan:
        """(handles, done) for the replicas on this machine outside the group: their spares written
        ({"kind": "spare", "replicas": [...]}), or where that cannot be (a LoRA push, no spare
        lent, a concurrent push writing them) one segment of ours shared for all of them. The
        caller calls done() once the update returned (the spares may be written again, the
        segment is closed)."""
        from weight_sync import SharedWeights

        named = [(n, t.cpu()) for n, t in named]  # (a CPU server's shared memory)
        if lora_name is None and self._sharing.acquire(blocking=False):
            try:
                handles = yield from self._write_spare(named, dtype, self.beside)
            except BaseException:
                self._sharing.release()
                raise
            if handles is not None:
                return handles, self._sharing.release
            self._sharing.release()
        segment = SharedWeights()
        try:
            one = segment.share(named, dtype)
        except BaseException:
            segment.close()
            raise
        return {"replicas": [dict(one, replica=r) for r in self.beside]}, segment.close

    def _write_spare(self, named: list, dtype, replicas: list[int] | None = None) -> Plan:
        """Handles for the tensors written into the server's leased spare (every replica's, or
        `replicas`', one after the other: {"kind": "spare", "replicas": [each one's handles]}), or
        None where it lends none or the push does not fit it (SpareWriter.write); a replica
        written before the one that did not fit keeps its lease until the update that uses it or
        the lease's TTL."""
        if not self._spare_lent or not all(t.device.type == "cpu" for _, t in named):
            return None
        try:
            lease = yield lambda c: c.lease_weight_spare(self.holder, self._writer(0).layouts, replicas)
        except RolloutAPIError as e:
            if e.status != 409:  # not lent by this server (CPU replicas only), or no such route
                self._spare_lent = False
            return None  # (409: another trainer holds it now)
        leases = lease.get("replicas", [lease])
        for gone in set(self.spare) - {one["replica"] for one in leases} - {0}:  # (scaled away; 0's names the layouts)
            self.spare.pop(gone).close()
        parts = []
        for one in leases:
            handles = self._writer(one["replica"]).write(one, named, dtype)
            if handles is None:
                return None
            parts.append(dict(handles, replica=one["replica"]))
        return {"kind": "spare", "replicas": parts} if "replicas" in lease else parts[0]

    def _writer(self, replica: int):
        """The SpareWriter of a replica's spare (each keeps its segments mapped between pushes)."""
        from weight_sync import SpareWriter

        if replica not in self.spare:
            self.spare[replica] = SpareWriter()
        return self.spare[replica]


def _check_increases(version: int, live: int) -> None:
    if version <= live:
        raise RolloutAPIError(409, f"weight versions must increase: {version} is not above the live version {live}",
                              "engine_state_error", "weight_version")


def _push_result(answer: dict, send: dict | None, t0: float) -> dict:
    """push_weights' result: the server's /weights/update answer ("update": its phases, stats),
    the sender's stats ("send"; None when nothing crossed the group: shared memory, or the
    server replayed an earlier push with this key)."""
    return {"weight_version": answer["weight_version"], "seconds": time.perf_counter() - t0, "send": send,
            "update": answer, "num_sends": 0 if send is None else 1, "aborted": answer.get("aborted", 0),
            "kept": answer.get("kept", 0), "paused_seconds": answer.get("paused_seconds"),
            "phases": answer.get("phases", {}), "replayed": answer.get("replayed", False)}
