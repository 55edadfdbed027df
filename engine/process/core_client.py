"""The frontend's handle on the engine cores: in process, or engine-core processes over ZMQ.

    InprocClient    one EngineCore in this process (tests, debugging)
    SyncMPClient    engine-core processes, one per data-parallel replica; blocking calls (LLM)
    AsyncMPClient   the same with asyncio (AsyncLLM)

Data parallelism: every new request goes to the least-loaded live replica (this frontend's
requests in flight there, and the queue depths the DP coordinator publishes, when one runs) and
stays there (aborts, streaming input); the n samples of one prompt go together (they share its
KV blocks). Control calls go to every live replica; their answers are combined by `combine`.
A weight update is two-phase (`weight_update_plan`): every replica stages it, and it goes live
on all of them only when all staged, under one version.

A replica that dies (crash, kill -9, exception in a step) is noticed within a second: its
requests and calls fail with EngineDeadError, the others keep serving. When every replica is
gone, every waiting and later call fails with EngineDeadError.
"""
import asyncio
import itertools
import logging
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core.engine_core import stale_version
from engine.errors import EngineDeadError, EngineStateError, InvalidRequestError, remote_error
from engine.process.coordinator import DPCoordinator
from engine.process.core_proc import HANDSHAKE_TIMEOUT_MS, engine_identity
from engine.process.managers import (CoreEngineActorManager, CoreEngineProcManager, EngineWatcher, available_memory,
                                     check_replica_count)
from engine.process.serial import MsgpackDecoder, MsgpackEncoder
from engine.protocol import (DPLoads, EngineAddresses, EngineConnection, EngineCoreOutput, EngineCoreOutputs,
                             EngineCoreRequest, FinishReason, RequestType, StreamInput, UtilityOutput, UtilityRequest)

logger = logging.getLogger("engine")


# ---- answers of several replicas, and the two-phase weight update ----------------------------------
def combine(method: str, results: list) -> Any:
    """One answer from every live replica's answer to a utility call."""
    if method == "get_stats":
        return combine_stats(results)
    if len(results) == 1:
        return results[0]
    if method in ("collective_rpc", "init_weight_transfer", "stop_profile"):  # one entry per worker / replica
        return [r for rs in results for r in rs]
    if method == "pause":
        return dict(results[0], aborted=sum(r["aborted"] for r in results), kept=sum(r["kept"] for r in results))
    if method in ("is_paused", "is_sleeping"):
        return any(results)
    if method in ("resume", "wake_up"):
        seconds = [r["paused_seconds"] for r in results if r.get("paused_seconds") is not None]
        merged = dict(results[0], paused_seconds=max(seconds) if seconds else None)
        if "is_sleeping" in merged:
            merged["is_sleeping"] = any(r["is_sleeping"] for r in results)
        return merged
    if method in ("weights_checksum", "get_weight_version") and len(set(results)) > 1:
        raise EngineStateError(f"the data-parallel replicas disagree on {method}: {results}")
    return results[0]


_SUMMED_STATS = ("num_running", "num_waiting", "num_preemptions", "num_prefill_tokens", "num_generated_tokens",
                 "num_free_blocks", "num_blocks", "peak_rss_mb", "encoder_cache_hits", "encoder_cache_queries")


def combine_stats(stats: list[dict]) -> dict:
    """Totals over the replicas, and each replica's own stats under "replicas"."""
    out = dict(stats[0], num_replicas_alive=len(stats), replicas=stats)
    if len(stats) == 1:
        return out
    for k in _SUMMED_STATS:
        if k in out:  # (the encoder cache's only with a vision-language model)
            out[k] = sum(s[k] for s in stats)
    out["kv_usage"] = 1.0 - out["num_free_blocks"] / max(out["num_blocks"], 1)
    out["prefix_hit_rate"] = sum(s["prefix_hit_rate"] for s in stats) / len(stats)
    out["weight_version"] = max(s["weight_version"] for s in stats)
    out["is_paused"] = any(s["is_paused"] for s in stats)
    out["is_sleeping"] = any(s["is_sleeping"] for s in stats)
    out["paused_seconds"] = max(s["paused_seconds"] for s in stats)
    return out


def check_room_for(config: EngineConfig, num_new: int, stats: dict) -> None:
    """InvalidRequestError (data_parallel_size) if this machine's free memory cannot hold `num_new`
    more local replicas like the one whose get_stats() is `stats` (its peak RSS plus the whole KV
    cache, whose pages it touches only as they fill)."""
    kv_bytes = stats["num_blocks"] * config.block_size * config.kv_bytes_per_token()
    on_host = 0 if config.device.startswith("cuda") else kv_bytes
    each = int(stats["peak_rss_mb"] * 2**20) + on_host
    free = available_memory()
    if num_new * each > free:
        raise InvalidRequestError(
            f"{num_new} more replica(s) need about {num_new * each / 2**30:.1f} GiB ({each / 2**30:.2f} GiB each: "
            f"a replica's peak RSS and its KV cache); this machine has {free / 2**30:.1f} GiB available",
            "data_parallel_size")


def weight_update_plan(source: str, args: list, version: int | None, lora_id: int = 0) -> Generator:
    """Stage the update on every replica; if one refuses, discard it everywhere and raise that
    refusal; else make it live everywhere under one version (default: the newest + 1). Versions
    increase strictly, so a token's version names one set of weights: a version at or below the
    live one is refused (409) after staging, so that a trainer's sender never blocks on a
    receiver that walked away. `lora_id`: an update of that LoRA adapter (its own versions)."""
    staged = yield ("each", "stage_weights", [source, args, lora_id])
    failures = [r for r in staged if isinstance(r, BaseException)]
    if not failures and version is not None:
        stale = stale_version(version, max(s["weight_version"] for s in staged))
        failures = [stale] if stale else []
    if failures:
        yield ("each", "discard_weights", [])
        raise failures[0]
    if version is None:
        version = max(s["weight_version"] for s in staged) + 1
    yield ("all", "commit_weights", [version, lora_id, staged[0].get("lora_path")])
    return dict(staged[0], weight_version=version)


class _SyncPlans:
    """run_plan for the blocking clients: ("all", method, args) -> the combined answer (raises);
    ("each", method, args) -> one answer or exception per live replica."""

    def run_plan(self, plan: Generator) -> Any:
        value = None
        while True:
            try:
                how, method, args = plan.send(value)
            except StopIteration as stop:
                return stop.value
            value = self.call_utility(method, *args) if how == "all" else self.call_utility_each(method, *args)

    def update_weights(self, source: str, args: list, version: int | None, lora_id: int = 0) -> dict:
        return self.run_plan(weight_update_plan(source, args, version, lora_id))


# ---- in process ------------------------------------------------------------------------------------
class InprocClient(_SyncPlans):
    """The core in this process: calls are direct, outputs come from step()."""

    def __init__(self, config: EngineConfig):
        from engine.core.engine_core import EngineCore

        if config.data_parallel_size > 1:
            raise ValueError("data parallelism needs engine-core processes (multiprocess=True)")
        self.core = EngineCore(config)
        self.num_blocks, self.max_model_len = self.core.num_blocks, self.core.max_model_len
        self._outputs: list = []

    def add_requests(self, groups: list[list[EngineCoreRequest]]) -> None:
        for group in groups:
            for req in group:
                self.core.add_request(req)

    def add_stream_input(self, chunk: StreamInput) -> None:
        self.core.add_stream_input(chunk)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._outputs.extend(self.core.abort_requests(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        outputs, self._outputs = self._outputs, []
        if not outputs and not self.core.has_work():
            raise EngineStateError("nothing can run: the engine is paused or asleep")
        return EngineCoreOutputs(outputs=outputs + self.core.step())

    def call_utility(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        """Call a core method now (`timeout` is moot in process); a Deferred answer is settled by
        stepping the core, keeping the outputs for get_output()."""
        from engine.core.engine_core import Deferred

        if method.startswith("_") or not callable(getattr(self.core, method, None)):
            raise ValueError(f"the engine core has no method {method!r}")
        result = getattr(self.core, method)(*args, **kwargs)
        if isinstance(result, Deferred):  # step the core until it can answer (outputs are kept)
            while not result.done():
                if self.core.has_work():
                    self._outputs.extend(self.core.step())
                elif result.needs_steps:
                    raise EngineStateError(f"{method} cannot finish: nothing in the engine can run")
                else:
                    time.sleep(0.005)
            result = result.finish()
        return result

    def call_utility_each(self, method: str, *args) -> list:
        try:
            return [self.call_utility(method, *args)]
        except Exception as e:
            return [e]

    def check_health(self) -> dict:
        return {"replicas": [0], "alive": [0], "stalled": []}

    def replica_ranks(self) -> list[int]:
        return [0]

    def shutdown(self) -> None:
        self.core.shutdown()


# ---- engine-core processes -----------------------------------------------------------------------
def _bind(sock: zmq.Socket, folder: str, name: str, tcp: bool) -> str:
    """Bind an ipc socket in `folder`, or (engines on other nodes) a TCP port on this node's IP."""
    if not tcp:
        sock.bind(f"ipc://{folder}/{name}")
    else:
        sock.bind(f"tcp://{_node_ip()}:0")
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


@dataclass
class EngineState:
    """One replica as this frontend sees it."""

    index: int
    identity: bytes
    rank: int = 0  # its data_parallel_rank: its slot among the live replicas (pinning, group ranks)
    alive: bool = True
    routable: bool = True  # new requests may go there (not while joining or draining)
    num_in_flight: int = 0  # this frontend's unfinished requests there
    load: int = 0  # waiting + running there, as the DP coordinator last published it
    heartbeat_at: float | None = None  # time.monotonic() of its last heartbeat here (None: none yet)
    busy: tuple[float, str] = (0.0, "")  # that heartbeat's (seconds inside one step or call, which)

    def beat(self, hb) -> None:
        self.heartbeat_at, self.busy = time.monotonic(), (hb.busy_s, hb.doing)

    def stalled(self, timeout: float) -> dict | None:
        """{"replica", "seconds", "in"} if its last heartbeat is `timeout` seconds old or says it
        is `timeout` into one piece of work; else None (also before its first heartbeat)."""
        if self.heartbeat_at is None:
            return None
        now = time.monotonic()
        silent = now - self.heartbeat_at
        busy = self.busy[0] + silent if self.busy[0] else 0.0
        if silent >= timeout:
            return {"replica": self.index, "seconds": round(silent, 1), "in": "no heartbeat"}
        if busy >= timeout:
            return {"replica": self.index, "seconds": round(busy, 1), "in": self.busy[1]}
        return None


class _MPClientBase:
    def __init__(self, config: EngineConfig, ctx: zmq.Context, with_coordinator: bool = False,
                 connection: EngineConnection | None = None):
        self.config = config
        if connection is None:  # before any socket or process exists
            check_replica_count(config, config.data_parallel_size)
        self.client_index, self.client_count = (0, 1) if connection is None else (connection.client_index,
                                                                                   connection.client_count)
        self._tmpdir = tempfile.mkdtemp(prefix="rollout-io-")
        ray = config.data_parallel_backend == "ray"  # engines may be on other nodes: TCP, not ipc
        self.ctx = ctx
        self.input_socket = ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        if connection is not None:
            self.input_socket.bind(connection.input_address)
            self.output_socket.bind(connection.output_address)
            self.input_address, self.output_address = connection.input_address, connection.output_address
        else:
            self.input_address = _bind(self.input_socket, self._tmpdir, "input", ray)
            self.output_address = _bind(self.output_socket, self._tmpdir, "output", ray)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self.engines = {i: EngineState(i, engine_identity(i), rank=i) for i in range(config.data_parallel_size)}
        self._indices_used = set(self.engines)
        self.owner: dict[str, EngineState] = {}  # request id -> its replica (until its final output)
        self._next_engine = 0  # round-robin start among equally loaded replicas
        self._death_lock = threading.Lock()
        self._death_socket: zmq.Socket | None = None  # the monitor's way into our own output stream
        self.coordinator: DPCoordinator | None = None
        if connection is not None:  # engines another process started and owns
            self.coordinator_address = connection.coordinator_address
            self.manager = EngineWatcher(connection.engine_pids, self._engine_died)
            self.num_blocks, self.max_model_len = connection.num_blocks, connection.max_model_len
        else:
            self._start_engines(config, with_coordinator, ray)
        weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        self._wait_for_engines([e.identity for e in self.engines.values()])

    def _start_engines(self, config: EngineConfig, with_coordinator: bool, ray: bool) -> None:
        self.coordinator = DPCoordinator(self._tmpdir, _node_ip() if ray else None) if with_coordinator else None
        self.coordinator_address = self.coordinator.frontend_address if self.coordinator else ""
        addresses = EngineAddresses([self.input_address], [self.output_address],
                                    self.coordinator.engine_address if self.coordinator else "")
        manager_cls = CoreEngineActorManager if ray else CoreEngineProcManager
        try:
            self.manager = manager_cls(config, addresses, self._engine_died)
        except BaseException:
            if self.coordinator is not None:
                self.coordinator.shutdown()
            # open sockets would make the context's garbage collection (zmq term) block forever
            self.input_socket.close(linger=0)
            self.output_socket.close(linger=0)
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            raise
        if self.coordinator is not None:
            weakref.finalize(self, DPCoordinator.shutdown, self.coordinator)
        self.num_blocks, self.max_model_len = self.manager.num_blocks, self.manager.max_model_len
        weakref.finalize(self, manager_cls.shutdown, self.manager)

    def _wait_for_engines(self, identities: list[bytes]) -> None:
        """Every engine's DEALER announces itself; until then the ROUTER cannot address it."""
        sync_view = zmq.Socket.shadow(self.input_socket.underlying)
        left = set(identities)
        while left:
            if not sync_view.poll(HANDSHAKE_TIMEOUT_MS):
                self.manager.shutdown()
                raise RuntimeError(f"engine cores {sorted(left)} did not connect their input sockets")
            left.discard(sync_view.recv_multipart()[0])

    # ---- routing ------------------------------------------------------------------------------
    def replica_ranks(self) -> list[int]:
        """The live replicas' data_parallel_ranks, in the order their workers join a weight group."""
        return [e.rank for e in self._live()]

    def _live(self, routable: bool = False) -> list[EngineState]:
        live = [e for e in self.engines.values() if e.alive and (e.routable or not routable)]
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine core is alive")
        return live

    def _choose_engine(self) -> EngineState:
        """The least-loaded live replica (ties: round robin)."""
        live = self._live(routable=True)
        start = self._next_engine % len(live)
        self._next_engine += 1
        order = live[start:] + live[:start]
        return min(order, key=lambda e: max(self.client_count * e.num_in_flight, e.load))

    def _assign(self, group: list[EngineCoreRequest]) -> EngineState:
        engine = self._choose_engine()
        for req in group:
            self.owner[req.request_id] = engine
        engine.num_in_flight += len(group)
        return engine

    def _finished(self, outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            if o.finished:
                engine = self.owner.pop(o.request_id, None)
                if engine is not None:
                    engine.num_in_flight -= 1

    def _engine_of(self, request_id: str) -> EngineState | None:
        return self.owner.get(request_id)

    def _by_engine(self, request_ids: list[str]) -> list[tuple[EngineState, list[str]]]:
        """The live replicas holding these requests, each with its ids (unknown ids: dropped)."""
        if self.dead_reason is not None:
            return []
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self._engine_of(rid)
            if engine is not None and engine.alive:
                groups.setdefault(engine.index, []).append(rid)
        return [(self.engines[i], rids) for i, rids in groups.items()]

    def _frames(self, engine: EngineState, kind: RequestType, obj) -> list:
        return [engine.identity, kind.value, *self.encoder.encode(obj)]

    # ---- replica death --------------------------------------------------------------------------
    def _engine_died(self, index: int, reason: str) -> None:
        """From the manager's monitor thread: tell our own output stream, so the reader handles
        it in order with everything the replica sent before dying."""
        with self._death_lock:
            if self._death_socket is None:
                self._death_socket = zmq.Context.instance().socket(zmq.PUSH)
                self._death_socket.setsockopt(zmq.LINGER, 0)
                self._death_socket.connect(self.output_address)
            self._death_socket.send(msgspec.msgpack.encode(EngineCoreOutputs(engine_dead=reason,
                                                                             engine_index=index)))

    def _set_dead(self, index: int, reason: str) -> None:
        """Replica `index` is gone (sets dead_reason when it was the last one)."""
        if index in self.engines:
            self.engines[index].alive = False
        if not any(e.alive for e in self.engines.values()):
            self.dead_reason = reason

    def _lost_requests(self, index: int, reason: str) -> list[EngineCoreOutput]:
        """The final (failed) outputs of the requests a dead replica held."""
        engine = self.engines.get(index)
        lost = [rid for rid, e in self.owner.items() if e is engine]
        for rid in lost:
            del self.owner[rid]
        if engine is not None:
            engine.num_in_flight = 0
        return [EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT, error=reason,
                                 error_type="EngineDeadError") for rid in lost]

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _beat(self, outs: EngineCoreOutputs) -> None:
        engine = self.engines.get(outs.engine_index)
        if engine is not None:
            engine.beat(outs.heartbeat)

    def check_health(self) -> dict:
        """{"replicas": [indices], "alive": [indices], "stalled": [{"replica", "seconds", "in"}]}
        (stalled: alive, but no heartbeat or no progress for engine_stall_timeout_s; see
        protocol.Heartbeat); EngineDeadError when none is alive."""
        self._check_alive()
        alive = [i for i, e in self.engines.items() if e.alive and self.manager.is_alive(i)]
        if not alive:
            raise EngineDeadError("no engine-core process is running")
        timeout = self.config.engine_stall_timeout_s
        stalled = [s for i in alive if (s := self.engines[i].stalled(timeout)) is not None]
        return {"replicas": sorted(self.engines), "alive": alive, "stalled": stalled}

    def _apply_loads(self, msg: bytes) -> None:
        """A DPLoads message from the coordinator: every replica's waiting + running."""
        for index, load in msgspec.msgpack.decode(msg, type=DPLoads).loads:
            if index in self.engines:
                self.engines[index].load = load

    def _close_sockets(self) -> None:
        if self.coordinator is not None:
            self.coordinator.shutdown()
        with self._death_lock:
            if self._death_socket is not None:
                self._death_socket.close(linger=0)
                self._death_socket = None


class SyncMPClient(_MPClientBase, _SyncPlans):
    """Blocking client: a background thread reads outputs into a queue; utility results are
    matched to their callers by call id."""

    def __init__(self, config: EngineConfig):
        super().__init__(config, zmq.Context())
        self.outputs: queue.Queue = queue.Queue()
        self._pending: dict[int, tuple[queue.Queue, int]] = {}  # call id -> (waiter, replica)
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._reader, daemon=True, name="core-output-reader").start()

    def _reader(self) -> None:
        sock = self.output_socket  # owned by this thread from now on
        while True:
            if not sock.poll(200):
                if self._closed:
                    sock.close(linger=0)
                    return
                continue
            outs: EngineCoreOutputs = self.decoder.decode(sock.recv_multipart(copy=False))
            if outs.heartbeat is not None:
                self._beat(outs)
                continue
            if outs.engine_dead is not None:
                self._set_dead(outs.engine_index, outs.engine_dead)
                self._fail_calls(outs.engine_index, outs.engine_dead)
                self.outputs.put(outs)  # get_output fails the replica's requests, in order
                continue
            if outs.utility_output is not None:
                with self._lock:
                    waiter, _ = self._pending.pop(outs.utility_output.call_id, (None, None))
                if waiter is not None:
                    waiter.put(outs.utility_output)
            if outs.outputs:
                self.outputs.put(outs)

    def _fail_calls(self, index: int, reason: str) -> None:
        with self._lock:
            failed = [cid for cid, (_, i) in self._pending.items() if i == index]
            waiters = [self._pending.pop(cid)[0] for cid in failed]
        for waiter in waiters:
            waiter.put(EngineDeadError(reason))

    def _send(self, engine: EngineState, kind: RequestType, obj) -> None:
        self._check_alive()
        if not engine.alive:
            raise EngineDeadError(f"engine core {engine.index} is dead")
        try:
            self.input_socket.send_multipart(self._frames(engine, kind, obj), copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach engine core {engine.index}: {e}") from e

    def add_requests(self, groups: list[list[EngineCoreRequest]]) -> None:
        """Route each group (one prompt's n samples) to a replica; each replica gets its share in
        one message, so it admits it whole and the first step's batch (and with it every result)
        does not depend on how fast the requests arrived."""
        by_engine: dict[int, list[EngineCoreRequest]] = {}
        for group in groups:
            by_engine.setdefault(self._assign(group).index, []).extend(group)
        for index, reqs in by_engine.items():
            self._send(self.engines[index], RequestType.ADD_MANY, reqs)

    def add_stream_input(self, chunk: StreamInput) -> None:
        engine = self._engine_of(chunk.request_id)
        if engine is not None:
            self._send(engine, RequestType.STREAM_INPUT, chunk)

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, rids in self._by_engine(request_ids):
            self._send(engine, RequestType.ABORT, rids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        while True:
            self._check_alive()
            outs = self.outputs.get(timeout=timeout)
            if outs.engine_dead is not None:
                lost = self._lost_requests(outs.engine_index, outs.engine_dead)
                if self.dead_reason is not None:
                    self.outputs.put(outs)  # wake any other waiter too
                    raise EngineDeadError(self.dead_reason)
                if not lost:
                    continue
                outs = EngineCoreOutputs(outputs=lost, engine_index=outs.engine_index)
            self._finished(outs.outputs)
            return outs

    def _call(self, engine: EngineState, method: str, args, kwargs) -> queue.Queue:
        call_id = next(self._call_ids)
        waiter: queue.Queue = queue.Queue()
        with self._lock:
            self._pending[call_id] = (waiter, engine.index)
        self._send(engine, RequestType.UTILITY, UtilityRequest(call_id, method, list(args), kwargs))
        return waiter

    def _answer(self, waiter: queue.Queue, method: str, timeout: float | None) -> Any:
        try:
            result = waiter.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{method} did not answer within {timeout} s") from None
        if isinstance(result, Exception):
            raise result
        if result.failure is not None:
            raise remote_error(result.failure_type, result.failure, param=result.failure_param)
        return result.result

    def call_utility_each(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        """One answer (or the exception it raised) per live replica, in replica order."""
        waiters = [self._call(e, method, args, kwargs) for e in self._live()]
        results = []
        for waiter in waiters:
            try:
                results.append(self._answer(waiter, method, timeout))
            except Exception as e:
                results.append(e)
        return results

    def call_utility(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        results = self.call_utility_each(method, *args, timeout=timeout, **kwargs)
        error = next((r for r in results if isinstance(r, Exception)), None)
        if error is not None:
            raise error
        return combine(method, results)

    def shutdown(self) -> None:
        self._closed = True  # the reader closes the output socket
        self.manager.shutdown()
        self.input_socket.close(linger=0)
        self._close_sockets()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


class AsyncMPClient(_MPClientBase):
    """asyncio client. Outputs are read by whoever awaits get_output_async (AsyncLLM's single
    output handler); utility results resolve futures keyed by call id."""

    def __init__(self, config: EngineConfig, connection: EngineConnection | None = None):
        super().__init__(config, zmq.asyncio.Context(), with_coordinator=config.data_parallel_size > 1,
                         connection=connection)
        self._pending: dict[int, tuple[asyncio.Future, int]] = {}  # call id -> (future, replica)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_event: asyncio.Event | None = None
        self._loads_task: asyncio.Task | None = None

    async def _ensure_ready(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._dead_event = asyncio.Event()
            if self.dead_reason is not None:
                self._dead_event.set()
            if self.coordinator_address:
                self._loads_task = self._loop.create_task(self._watch_loads())

    async def _watch_loads(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.coordinator_address)
        try:
            while True:
                self._apply_loads(await sub.recv())
        finally:
            sub.close(linger=0)

    def _fail_calls(self, index: int | None, reason: str) -> None:
        """Fail the calls waiting on replica `index` (None: on every replica)."""
        failed = [cid for cid, (_, i) in self._pending.items() if index is None or i == index]
        for cid in failed:
            fut, _ = self._pending.pop(cid)
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    async def _send(self, engine: EngineState, kind: RequestType, obj) -> None:
        await self._ensure_ready()
        self._check_alive()
        if not engine.alive:
            raise EngineDeadError(f"engine core {engine.index} is dead")
        try:
            await self.input_socket.send_multipart(self._frames(engine, kind, obj), copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach engine core {engine.index}: {e}") from e

    async def add_requests_async(self, group: list[EngineCoreRequest]) -> None:
        """One prompt's requests (its n samples), to one replica."""
        await self._send(self._assign(group), RequestType.ADD_MANY if len(group) > 1 else RequestType.ADD,
                         group if len(group) > 1 else group[0])

    async def add_stream_input_async(self, chunk: StreamInput) -> None:
        engine = self._engine_of(chunk.request_id)
        if engine is not None:
            await self._send(engine, RequestType.STREAM_INPUT, chunk)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for engine, rids in self._by_engine(request_ids):
            await self._send(engine, RequestType.ABORT, rids)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message with request outputs; raises EngineDeadError when every core is gone."""
        await self._ensure_ready()
        while True:
            self._check_alive()
            recv = asyncio.ensure_future(self.output_socket.recv_multipart(copy=False))
            dead = asyncio.ensure_future(self._dead_event.wait())
            try:
                done, _ = await asyncio.wait({recv, dead}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when the output handler is cancelled at shutdown
                dead.cancel()
                if not recv.done():
                    recv.cancel()
            if recv not in done:
                raise EngineDeadError(self.dead_reason)
            outs: EngineCoreOutputs = self.decoder.decode(recv.result())
            if outs.heartbeat is not None:
                self._beat(outs)
                continue
            if outs.engine_dead is not None:
                self._set_dead(outs.engine_index, outs.engine_dead)
                lost = self._lost_requests(outs.engine_index, outs.engine_dead)
                self._fail_calls(outs.engine_index, outs.engine_dead)
                if self.dead_reason is not None:
                    self._fail_all()
                    raise EngineDeadError(self.dead_reason)
                if not lost:
                    continue
                outs = EngineCoreOutputs(outputs=lost, engine_index=outs.engine_index)
            if outs.utility_output is not None:
                fut, _ = self._pending.pop(outs.utility_output.call_id, (None, None))
                if fut is not None and not fut.done():
                    fut.set_result(outs.utility_output)
            if outs.outputs:
                self._finished(outs.outputs)
                return outs

    def _fail_all(self) -> None:
        self._dead_event.set()
        self._fail_calls(None, self.dead_reason)

    async def _call(self, engine: EngineState, method: str, args, kwargs, timeout: float | None) -> Any:
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        # A replica's death fails its calls' futures, also those whose caller already left (a
        # failed send, a timeout): mark the failure seen, or asyncio logs each one at ERROR.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._pending[call_id] = (fut, engine.index)
        try:
            await self._send(engine, RequestType.UTILITY, UtilityRequest(call_id, method, list(args), kwargs))
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        try:
            result: UtilityOutput = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(call_id, None)
            raise TimeoutError(f"{method} did not answer within {timeout} s") from None
        if result.failure is not None:
            raise remote_error(result.failure_type, result.failure, param=result.failure_param)
        return result.result

    async def call_utility_each_async(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        """One answer (or the exception it raised) per live replica, in replica order."""
        await self._ensure_ready()
        calls = [self._call(e, method, args, kwargs, timeout) for e in self._live()]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    async def call_utility_async(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        results = await self.call_utility_each_async(method, *args, timeout=timeout, **kwargs)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error
        return combine(method, results)

    async def update_weights_async(self, source: str, args: list, version: int | None, lora_id: int = 0) -> dict:
        plan = weight_update_plan(source, args, version, lora_id)
        value = None
        while True:
            try:
                how, method, step_args = plan.send(value)
            except StopIteration as stop:
                return stop.value
            call = self.call_utility_async if how == "all" else self.call_utility_each_async
            value = await call(method, *step_args)

    # ---- elastic size ------------------------------------------------------------------------------
    async def scale_async(self, size: int, drain_timeout_s: float = 60.0) -> dict:
        """Grow or shrink to `size` live replicas. New ones copy a live replica's weights (pushed
        ones included), LoRA adapters and pause state before they take requests; removed ones (the newest
        first) take no new requests, their requests get `drain_timeout_s` to finish, then are
        aborted with a final output. Dead replicas are dropped (a scale to the same size
        replaces them)."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidRequestError(f"data_parallel_size must be an int >= 1, got {size!r}", "data_parallel_size")
        if isinstance(self.manager, EngineWatcher):
            raise EngineStateError("the engine cores belong to the launcher of several API servers: "
                                   "scaling is not supported there")
        check_replica_count(self.config, size)  # before anything starts or stops
        await self._ensure_ready()
        live = sorted(i for i, e in self.engines.items() if e.alive)
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine core is alive")
        state = None
        if size > len(live):
            state = await self._call(self.engines[live[0]], "get_stats", [], {}, None)
            if state["is_sleeping"]:
                raise EngineStateError("the engine is asleep: wake it up before scaling")
            if self.config.data_parallel_backend == "mp":
                check_room_for(self.config, size - len(live), state)
        dropped = [i for i, e in self.engines.items() if not e.alive]
        for i in dropped:
            del self.engines[i]
            self.manager.stop(i)
        added, removed = [], []
        if size > len(live):
            added = await self._scale_up(size - len(live), state)
        elif size < len(live):
            removed = await self._scale_down(live[size:], drain_timeout_s)
        return {"data_parallel_size": len(self.engines), "added": added, "removed": removed + dropped}

    async def _scale_up(self, n: int, state: dict) -> list[int]:
        """Start n replicas, copy `state`'s replica (its get_stats()) into them, then route to them;
        a failure at any point stops every new one and leaves the others as they were."""
        from weight_sync import find_free_port

        source = self.engines[min(self.engines)]
        first = max(self._indices_used) + 1
        new = list(range(first, first + n))  # an index is never reused: identities stay unique
        self._indices_used.update(new)
        taken = {e.rank for e in self.engines.values()}
        ranks = [r for r in range(len(self.engines) + n) if r not in taken][:n]  # the slots the dead left first
        for i, rank in zip(new, ranks):
            self.engines[i] = EngineState(i, engine_identity(i), rank=rank, routable=False)
        try:
            await asyncio.to_thread(self.manager.start, new, ranks)
            await self._await_registrations({engine_identity(i) for i in new})
            host = await self._call(source, "collective_rpc", ["node_ip_address"], {}, None)
            port = find_free_port(host[0])
            copies = [self._call(self.engines[i], "stage_weights", ["peer", [host[0], port, n + 1, j + 1]], {}, None)
                      for j, i in enumerate(new)]
            await asyncio.gather(self._call(source, "send_weights_to_peers", [host[0], port, n + 1], {}, None),
                                 *copies)
            loras = await self._call(source, "export_loras", [], {}, None)
            for i in new:
                await self._call(self.engines[i], "commit_weights", [state["weight_version"]], {}, None)
                if loras:  # the adapters too, pushed ones with their tensors
                    await self._call(self.engines[i], "import_loras", [loras], {}, None)
                if state["is_paused"]:  # held (abort / wait) or frozen (keep) like the others
                    mode = "keep" if state["pause_state"] == "paused_all" else "abort"
                    await self._call(self.engines[i], "pause", [mode, False], {}, None)
        except BaseException:
            for i in new:
                self.engines.pop(i, None)
                self.manager.stop(i)
            raise
        for i in new:
            self.engines[i].routable = True
        return new

    def cancel_scale(self) -> None:
        """Make a scale-up that is starting engines fail now (they are stopped; the others serve on)."""
        if not isinstance(self.manager, EngineWatcher):
            self.manager.cancel_start()

    async def _await_registrations(self, identities: set[bytes], timeout_s: float = HANDSHAKE_TIMEOUT_MS / 1000):
        """New engines' DEALERs announce themselves on our ROUTER (nothing else arrives there)."""
        deadline = time.monotonic() + timeout_s
        while identities:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"new engine cores did not connect: {sorted(identities)}")
            frames = await asyncio.wait_for(self.input_socket.recv_multipart(), left)
            identities.discard(frames[0])

    async def _scale_down(self, victims: list[int], drain_timeout_s: float) -> list[int]:
        for i in victims:
            self.engines[i].routable = False
        deadline = time.monotonic() + drain_timeout_s
        while any(self.engines[i].num_in_flight for i in victims) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = [rid for rid, e in self.owner.items() if e.index in victims]
        if left:  # past the deadline: their callers get a final output ("abort"), not silence
            await self.abort_requests_async(left)
            until = time.monotonic() + 10
            while any(self.engines[i].num_in_flight for i in victims) and time.monotonic() < until:
                await asyncio.sleep(0.05)
        for i in victims:
            del self.engines[i]
            self.manager.stop(i)
        return victims

    def shutdown(self) -> None:
        if self._loads_task is not None:
            self._loads_task.cancel()
        self.manager.shutdown()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self._close_sockets()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
