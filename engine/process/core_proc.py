"""The engine-core process: EngineCore in a busy loop, with IO threads moving ZMQ frames.

    frontend k ROUTER (bind) --[type byte, payload, tensor frames]--> DEALER k: input thread
        -> input queue -> busy loop: handle requests, step(), utility calls
        -> output queue -> output thread: PUSH k --> frontend k PULL (bind)
                                          PUSH  --> DP coordinator (queue depth, when it changes)

One engine core is one data-parallel replica (`engine_index`); it serves every frontend (API
server) it was given addresses for, and answers each on its own socket: requests remember
which frontend sent them. With one frontend (the usual case) nothing is tracked.

The IO threads do the (de)serialization, so it overlaps the forward pass (torch releases
the GIL). Startup handshake over a separate DEALER (identity = engine index): HELLO ->
{addresses, config} -> READY {num_blocks, max_model_len} (or the failure). The process dies
with its parent (PR_SET_PDEATHSIG, plus a parent-pid watchdog), so no orphan is left behind.
"""
import contextlib
import gc
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core.engine_core import Deferred, EngineCore
from engine.errors import InvalidRequestError
from engine.lifetime import PARENT_DEATH_SIGNAL, die_with_parent
from engine.serial import MsgpackDecoder, MsgpackEncoder
from engine.process.utility import bind
from engine.process.waves import BARRIER_WAIT_S, IDLE_SPIN_S, LOCAL_CALLS, BarrierCall, Lockstep
from engine.protocol import (EngineAddresses, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineLoad,
                             FinishReason, Heartbeat, Hello, Ready, RequestType, Startup, StreamInput, UtilityOutput,
                             UtilityRequest, WaveEvent)
from engine.worker.weight_buffers import remove_segments

DEFERRED_POLL_S = 0.005
logger = logging.getLogger("engine")
HANDSHAKE_TIMEOUT_MS = 30_000
TO_COORDINATOR = -1  # output-queue destination of load reports


def engine_identity(engine_index: int) -> bytes:
    """The ZMQ identity of engine core `engine_index` on every frontend's ROUTER."""
    return engine_index.to_bytes(2, "little")


def run_engine_core(handshake_address: str, parent_pid: int, engine_index: int = 0) -> None:
    """Entry point of an engine-core process (started by CoreEngineProcManager)."""
    folders = {handshake_address}  # ipc socket folders; more once the startup message names them

    def on_parent_death(*_):  # nobody is left to remove the ipc socket folders: do it, then go
        for address in folders:
            if address.startswith("ipc://"):
                shutil.rmtree(os.path.dirname(address[len("ipc://"):]), ignore_errors=True)
        remove_segments()
        os._exit(1)

    def on_stop(*_):  # the frontend stops us (os._exit: no finalizer runs, so shared memory goes here)
        remove_segments()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it shuts us down
    signal.signal(PARENT_DEATH_SIGNAL, on_parent_death)
    die_with_parent(parent_pid, on_parent_death)
    logging.basicConfig(level=logging.WARNING, format=f"[engine-core {engine_index}] %(levelname)s %(message)s")
    ctx = zmq.Context()
    hs = ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.LINGER, 1000)
    hs.setsockopt(zmq.IDENTITY, engine_identity(engine_index))
    hs.connect(handshake_address)
    hs.send(msgspec.msgpack.encode(Hello(os.getpid())))
    if not hs.poll(HANDSHAKE_TIMEOUT_MS):
        sys.exit("engine core: no startup message from the frontend")
    startup = msgspec.msgpack.decode(hs.recv(), type=Startup)
    folders.update(startup.addresses.inputs + startup.addresses.outputs + [startup.addresses.coordinator])
    try:
        core = EngineCore(EngineConfig(**startup.config))
    except Exception as e:  # report why, then exit: the frontend raises it
        hs.send(msgspec.msgpack.encode(Ready(failure=f"{type(e).__name__}: {e}")))
        hs.close()
        sys.exit(1)
    hs.send(msgspec.msgpack.encode(Ready(core.num_blocks, core.max_model_len)))
    hs.close()
    # What start-up made (torch, transformers, the model) lives as long as the process: frozen, a
    # full collection no longer walks it (unfrozen, one stalled a step or a call for ~0.1 s).
    gc.collect()
    gc.freeze()
    EngineCoreProc(core, ctx, startup.addresses, engine_index).run()


class EngineCoreProc:
    def __init__(self, core: EngineCore, ctx: zmq.Context, addresses: EngineAddresses, engine_index: int = 0):
        self.core = core
        self.engine_index = engine_index
        self.input_queue: queue.Queue = queue.Queue()  # (frontend, kind, message)
        self.output_queue: queue.Queue = queue.Queue()  # (frontend or TO_COORDINATOR, message)
        self.ctx = ctx
        self.addresses = addresses
        self.num_clients = len(addresses.inputs)
        self.client_of: dict[str, int] = {}  # request id -> the frontend that sent it (several frontends only)
        self.deferred: list[tuple[int, int, Deferred]] = []  # (frontend, call id, answer once it holds)
        self._last_load: tuple[int, int] | None = None
        self.busy: tuple[str, float] | None = None  # (what, since when) the busy loop is doing; None: idle
        core.executor.on_death = self._die  # a tensor-parallel rank that dies ends the replica
        # expert parallelism: the replicas step in lockstep (engine/process/waves.py)
        self.lockstep = Lockstep(core.ep_group) if core.ep_group is not None else None
        self.barrier_calls: list[BarrierCall] = []
        core.lockstep = self.lockstep is not None
        threading.Thread(target=self._input_thread, daemon=True, name="core-input").start()
        threading.Thread(target=self._output_thread, daemon=True, name="core-output").start()
        threading.Thread(target=self._heartbeat_thread, daemon=True, name="core-heartbeat").start()

    # ---- IO threads -----------------------------------------------------------------------
    def _input_thread(self) -> None:
        poller = zmq.Poller()
        sockets = []
        for address in self.addresses.inputs:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, engine_identity(self.engine_index))
            sock.connect(address)
            sock.send(b"")  # register our identity with the frontend's ROUTER
            poller.register(sock, zmq.POLLIN)
            sockets.append(sock)
        client = {sock: i for i, sock in enumerate(sockets)}
        waves = None
        if self.lockstep is not None and self.addresses.waves:  # the coordinator's START_DP_WAVE
            waves = self.ctx.socket(zmq.SUB)
            waves.setsockopt(zmq.SUBSCRIBE, b"")
            waves.connect(self.addresses.waves)
            poller.register(waves, zmq.POLLIN)
        decoders = {RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    RequestType.ADD_MANY: MsgpackDecoder(list[EngineCoreRequest]),
                    RequestType.STREAM_INPUT: MsgpackDecoder(StreamInput),
                    RequestType.ABORT: MsgpackDecoder(list[str]),
                    RequestType.UTILITY: MsgpackDecoder(UtilityRequest)}
        while True:
            for sock, _ in poller.poll() if len(sockets) > 1 or waves is not None else [(sockets[0], None)]:
                if sock is waves:
                    self.input_queue.put((0, RequestType.START_DP_WAVE, msgspec.msgpack.decode(sock.recv(), type=int)))
                    continue
                frames = sock.recv_multipart(copy=False)
                try:
                    kind = RequestType(bytes(frames[0].buffer))
                    self.input_queue.put((client[sock], kind, decoders[kind].decode(frames[1:])))
                except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:  # includes unknown kinds
                    logger.error("dropping an undecodable message (%s): %s", bytes(frames[0].buffer)[:16], e)

    def _heartbeat_thread(self) -> None:
        interval = self.core.config.heartbeat_interval_s
        while True:
            time.sleep(interval)
            busy = self.busy
            beat = Heartbeat(time.monotonic() - busy[1], busy[0]) if busy else Heartbeat(0.0)
            for client in range(self.num_clients):
                self.output_queue.put((client, EngineCoreOutputs(heartbeat=beat)))

    def _output_thread(self) -> None:
        pushes = []
        for address in self.addresses.outputs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            pushes.append(sock)
        coordinator = None
        if self.addresses.coordinator:
            coordinator = self.ctx.socket(zmq.PUSH)
            coordinator.setsockopt(zmq.LINGER, 0)
            coordinator.connect(self.addresses.coordinator)
        encoder = MsgpackEncoder()
        while True:
            dest, outputs = self.output_queue.get()
            if dest == TO_COORDINATOR:
                coordinator.send(msgspec.msgpack.encode(outputs), zmq.NOBLOCK)
                continue
            outputs.engine_index = self.engine_index
            try:
                frames = encoder.encode(outputs)
            except TypeError as e:  # a utility result that cannot travel
                u = outputs.utility_output
                assert u is not None, f"engine outputs must always encode: {e}"
                frames = encoder.encode(EngineCoreOutputs(utility_output=UtilityOutput(
                    u.call_id, failure=f"the result of the call cannot be sent back: {e}"),
                    engine_index=self.engine_index))
            if outputs.engine_dead is not None:  # every frontend learns it; linger flushes
                for sock in pushes:
                    sock.send_multipart(frames, copy=False)
                    sock.close()
                return
            if outputs.heartbeat is not None:  # dropped rather than queued behind a frontend that reads nothing
                with contextlib.suppress(zmq.Again):
                    pushes[dest].send_multipart(frames, zmq.NOBLOCK, copy=False)
                continue
            pushes[dest].send_multipart(frames, copy=False)

    # ---- busy loop --------------------------------------------------------------------------
    def run(self) -> None:
        if self.lockstep is not None:
            return self._run_lockstep()
        try:
            while True:
                self._take_input(idle=not self.core.has_work())
                if self.core.has_work():
                    self.busy = ("step", time.monotonic())
                    self._send(self.core.step(), time.monotonic())
                self._after_iteration()
        except BaseException as e:  # a bug in a step: every caller must learn it, now
            logger.error("%s", traceback.format_exc())
            self._die(f"{type(e).__name__}: {e}")

    def _take_input(self, idle: bool) -> None:
        """Handle what the IO threads queued; when idle, first block for it (or until something is due)."""
        if idle:
            self.busy = None
            try:
                self._handle(*self.input_queue.get(timeout=self._idle_timeout()))
            except queue.Empty:
                pass
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())

    def _after_iteration(self) -> None:
        if self.deferred:
            self._resolve_deferred()
        if self.addresses.coordinator:
            self._report_load()

    def _run_lockstep(self) -> None:
        """The busy loop of an expert-parallel replica (engine/process/waves.py)."""
        ls, core = self.lockstep, self.core
        try:
            while True:
                self._take_input(idle=not ls.in_wave and not core.has_work() and not self.barrier_calls)
                work = core.has_work()
                if not ls.in_wave and (work or self.barrier_calls):
                    ls.in_wave = True
                    self.output_queue.put((TO_COORDINATOR, WaveEvent(self.engine_index, ls.wave, True)))
                if ls.in_wave:
                    self._lockstep_iteration(work)
                self._after_iteration()
        except BaseException as e:  # a bug, or a replica gone (the group's collectives fail): all learn it
            logger.error("%s", traceback.format_exc())
            self._die(f"{type(e).__name__}: {e}")

    def _lockstep_iteration(self, work: bool) -> None:
        ls, head = self.lockstep, self.barrier_calls[0] if self.barrier_calls else None
        if head is not None and head.deferred is None and time.monotonic() - head.since > BARRIER_WAIT_S:
            self.barrier_calls.pop(0)  # (only this replica has it: the others decide nothing about it)
            self._answer(head.client, UtilityOutput(head.call_id, failure=(
                f"{head.method} reached this replica but not every replica within {BARRIER_WAIT_S:g} s: under expert "
                "parallelism calls that touch the weights run on all replicas at once")))
            head = self.barrier_calls[0] if self.barrier_calls else None
        ready = head is not None and (head.deferred is None or head.deferred.done())
        n_work, n_ready, n_pending = ls.sync(work, ready, head is not None)
        if n_ready == ls.size:
            self.busy = (head.method, time.monotonic())
            self._run_barrier_call(head)
        elif n_work:
            self.busy = ("step", time.monotonic())
            self._send(self.core.step(), time.monotonic())
        elif not n_pending:  # nothing anywhere: the wave ends on every replica in this iteration
            ls.in_wave = False
            ls.wave += 1
            if ls.rank == 0:
                self.output_queue.put((TO_COORDINATOR, WaveEvent(self.engine_index, ls.wave - 1, False)))
        else:
            time.sleep(IDLE_SPIN_S)  # a barrier call that some replica has not received yet

    def _run_barrier_call(self, call: BarrierCall) -> None:
        """Run (or finish) the call at the head of the queue: every replica does so in this iteration."""
        try:
            if call.deferred is None:
                result = getattr(self.core, call.method)(**call.kwargs)
                if isinstance(result, Deferred):
                    if not result.done():
                        call.deferred = result  # finished in a later iteration, when done on every replica
                        return
                    result = result.finish()
            else:
                result = call.deferred.finish()
        except Exception as e:
            self.barrier_calls.pop(0)
            return self._answer(call.client, UtilityOutput.failed(call.call_id, e))
        self.barrier_calls.pop(0)
        self._answer(call.client, UtilityOutput(call.call_id, result=result))

    def _die(self, why: str) -> None:
        """Tell every frontend, then exit (from any thread)."""
        msg = f"engine core {self.engine_index} died: {why}"
        logger.error("%s", msg)
        self.output_queue.put((0, EngineCoreOutputs(engine_dead=msg)))
        threading.Event().wait(2.0)  # let the output thread flush
        os._exit(1)

    def _idle_timeout(self) -> float | None:
        """None (block) unless a call waits on a thread (poll it) or a pause's deadline is due."""
        timeouts = [t for t in (DEFERRED_POLL_S if self.deferred else None, self.core.seconds_to_next_event())
                    if t is not None]
        return min(timeouts) if timeouts else None

    def _handle(self, client: int, kind: RequestType, msg) -> None:
        if kind in (RequestType.ADD, RequestType.ADD_MANY):
            for req in msg if kind == RequestType.ADD_MANY else [msg]:
                if self.num_clients > 1:
                    self.client_of[req.request_id] = client
                try:
                    self.core.add_request(req)
                except InvalidRequestError as e:  # fails this request only
                    self._reject(req.request_id, e)
        elif kind == RequestType.STREAM_INPUT:
            try:
                self.core.add_stream_input(msg)
            except InvalidRequestError as e:
                self.core.abort_requests([msg.request_id])
                self._reject(msg.request_id, e)
        elif kind == RequestType.ABORT:
            self._send(self.core.abort_requests(msg))
        elif kind == RequestType.UTILITY:
            if self.lockstep is not None and msg.method not in LOCAL_CALLS:
                try:
                    kwargs = bind(msg.method, msg.args, msg.kwargs)
                except Exception as e:  # bad arguments: refused at once, on every replica alike
                    return self._answer(client, UtilityOutput.failed(msg.call_id, e))
                self.barrier_calls.append(BarrierCall(client, msg.call_id, msg.method, kwargs))
                return
            self._call(client, msg)
        elif kind == RequestType.START_DP_WAVE:
            self.lockstep.join(msg)

    def _send(self, outputs: list[EngineCoreOutput], timestamp: float = 0.0) -> None:
        """Queue request outputs for the frontends that sent those requests."""
        if not outputs:
            return
        if self.num_clients == 1:
            self.output_queue.put((0, EngineCoreOutputs(outputs=outputs, timestamp=timestamp)))
            return
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for o in outputs:
            rid = o.request_id
            client = self.client_of.pop(rid, 0) if o.finished else self.client_of.get(rid, 0)
            by_client.setdefault(client, []).append(o)
        for client, outs in by_client.items():
            self.output_queue.put((client, EngineCoreOutputs(outputs=outs, timestamp=timestamp)))

    def _reject(self, request_id: str, error: InvalidRequestError) -> None:
        self._send([EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                                     error=str(error), error_type=type(error).__name__)])

    def _call(self, client: int, req: UtilityRequest) -> None:
        """A utility call (engine/process/utility.py: only the verbs of its table are reachable)."""
        self.busy = (req.method, time.monotonic())
        try:
            kwargs = bind(req.method, req.args, req.kwargs)
            result = getattr(self.core, req.method)(**kwargs)
        except Exception as e:  # reported to the caller; the engine keeps serving
            return self._answer(client, UtilityOutput.failed(req.call_id, e))
        if isinstance(result, Deferred):
            self.deferred.append((client, req.call_id, result))
        else:
            self._answer(client, UtilityOutput(req.call_id, result=result))

    def _resolve_deferred(self) -> None:
        waiting = []
        for client, call_id, d in self.deferred:
            if not d.done():
                waiting.append((client, call_id, d))
                continue
            try:
                self._answer(client, UtilityOutput(call_id, result=d.finish()))
            except Exception as e:
                self._answer(client, UtilityOutput.failed(call_id, e))
        self.deferred = waiting

    def _answer(self, client: int, out: UtilityOutput) -> None:
        """Send a utility result, after the request outputs the call produced (an abort-mode
        pause's final outputs reach the callers before the pause returns)."""
        self._send(self.core.take_pending_outputs())
        self.output_queue.put((client, EngineCoreOutputs(utility_output=out)))

    def _report_load(self) -> None:
        sched = self.core.scheduler
        load = (sched.num_waiting, len(sched.running))
        if load != self._last_load:
            self._last_load = load
            self.output_queue.put((TO_COORDINATOR, EngineLoad(self.engine_index, *load)))
