"""The frontend's handle on the engine cores: in process, or engine-core processes over ZMQ.

    InprocClient    one EngineCore in this process (tests, debugging)
    SyncMPClient    engine-core processes, one per data-parallel replica; blocking calls (LLM)
    AsyncMPClient   the same with asyncio (AsyncLLM)

Data parallelism: every new request goes to the least-loaded live replica (this frontend's
requests in flight there, and the queue depths the DP coordinator publishes, when one runs) and
stays there (aborts, streaming input); the n samples of one prompt go together (they share its
KV blocks). Control calls go to every live replica (a first_replica_only verb to the first);
their answers are combined by `combine`.
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
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineStateError, InvalidRequestError, remote_error
from engine.process.coordinator import DPCoordinator
from engine.process.core_proc import HANDSHAKE_TIMEOUT_MS, engine_identity
from engine.process.elastic import ElasticScaling
from engine.process.managers import CoreEngineActorManager, CoreEngineProcManager, EngineWatcher, check_replica_count
from engine.process.replicas import EngineState, Route, affinity
from engine.serial import MsgpackDecoder, MsgpackEncoder
from engine.timeouts import wait_within
from engine.process.utility import UpdateTrace, bind, combine, replicas_for, weight_update_plan
from engine.protocol import (DPLoads, EngineAddresses, EngineConnection, EngineCoreOutput, EngineCoreOutputs,
                             EngineCoreRequest, FinishReason, RequestType, StreamInput, UtilityOutput, UtilityRequest)

logger = logging.getLogger("engine")


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
            value = self.call_utility(method, **args) if how == "all" else self.call_utility_each(method, **args)

    def update_weights(self, source: str, args: list, version: int | None, lora_id: int = 0,
                       deadline_s: float | None = None, trace: UpdateTrace | None = None,
                       pause: dict | None = None) -> dict:
        return self.run_plan(weight_update_plan(source, args, version, lora_id, deadline_s, trace, pause,
                                                pause_first(self.config, lora_id)))


def pause_first(config: EngineConfig, lora_id: int) -> bool:
    """Whether an update that pauses generation must pause before staging (the engine cannot
    receive beside its steps: EngineCore.stage_weights) rather than only for the swap."""
    return not config.stages_weights_beside_steps or bool(lora_id)


# ---- in process ------------------------------------------------------------------------------------
class InprocClient(_SyncPlans):
    """The core in this process: calls are direct, outputs come from step()."""

    def __init__(self, config: EngineConfig):
        from engine.core.engine_core import EngineCore

        if config.data_parallel_size > 1:
            raise ValueError("data parallelism needs engine-core processes (multiprocess=True)")
        self.config = config
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

        kwargs = bind(method, args, kwargs)
        result = getattr(self.core, method)(**kwargs)
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

    def call_utility_each(self, method: str, *args, **kwargs) -> list:
        try:
            return [self.call_utility(method, *args, **kwargs)]
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
                                    self.coordinator.engine_address if self.coordinator else "",
                                    self.coordinator.waves_address if self.coordinator else "")
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

    def _choose_engine(self, route: Route | None = None) -> EngineState:
        """The replica `route` asks for (a data_parallel_rank, or the one a session key hashes
        to), else the least-loaded live replica (ties: round robin)."""
        live = self._live(routable=True)
        if route is not None and route.data_parallel_rank is not None:
            for e in live:
                if e.rank == route.data_parallel_rank:
                    return e
            raise InvalidRequestError(f"data_parallel_rank {route.data_parallel_rank} is not a replica taking "
                                      f"requests (live: {sorted(e.rank for e in live)})", "data_parallel_rank")
        if route is not None and route.session_key is not None:
            # Rendezvous hashing: every frontend (API server) picks the same replica for a key
            # without sharing state, and a scale moves only the keys of the replicas it changes.
            return max(live, key=lambda e: affinity(route.session_key, e.rank))
        start = self._next_engine % len(live)
        self._next_engine += 1
        order = live[start:] + live[:start]
        return min(order, key=lambda e: max(self.client_count * e.num_in_flight, e.load))

    def _assign(self, group: list[EngineCoreRequest], route: Route | None = None) -> EngineState:
        engine = self._choose_engine(route)
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
        # (expert-parallel replicas need the coordinator for their waves)
        super().__init__(config, zmq.Context(),
                         with_coordinator=config.enable_expert_parallel and config.data_parallel_size > 1)
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
        waiters = [self._call(e, method, args, kwargs) for e in replicas_for(method, self._live())]
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


class AsyncMPClient(ElasticScaling, _MPClientBase):
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

    async def add_requests_async(self, group: list[EngineCoreRequest], route: Route | None = None) -> None:
        """One prompt's requests (its n samples), to one replica (the one `route` names, if any)."""
        await self._send(self._assign(group, route), RequestType.ADD_MANY if len(group) > 1 else RequestType.ADD,
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
            result: UtilityOutput = await wait_within(fut, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(call_id, None)
            raise TimeoutError(f"{method} did not answer within {timeout} s") from None
        if result.failure is not None:
            raise remote_error(result.failure_type, result.failure, param=result.failure_param)
        return result.result

    async def call_utility_each_async(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        """One answer (or the exception it raised) per live replica, in replica order."""
        await self._ensure_ready()
        calls = [self._call(e, method, args, kwargs, timeout) for e in replicas_for(method, self._live())]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    async def call_utility_async(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        results = await self.call_utility_each_async(method, *args, timeout=timeout, **kwargs)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error
        return combine(method, results)

    async def update_weights_async(self, source: str, args: list, version: int | None, lora_id: int = 0,
                                   deadline_s: float | None = None, trace: UpdateTrace | None = None,
                                   pause: dict | None = None) -> dict:
        plan = weight_update_plan(source, args, version, lora_id, deadline_s, trace, pause,
                                  pause_first(self.config, lora_id))
        value = None
        while True:
            try:
                how, method, kwargs = plan.send(value)
            except StopIteration as stop:
                return stop.value
            call = self.call_utility_async if how == "all" else self.call_utility_each_async
            value = await call(method, **kwargs)

    def shutdown(self) -> None:
        if self._loads_task is not None:
            self._loads_task.cancel()
        self.manager.shutdown()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self._close_sockets()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
