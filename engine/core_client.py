"""The frontend's handle on the engine core: in process, or in a child process over ZMQ.

    InprocClient    EngineCore in this process (tests, debugging)
    SyncMPClient    the core in a child process; blocking calls (LLM)
    AsyncMPClient   the same with asyncio (AsyncLLM)

A child that dies (crash, kill -9, exception in a step) is noticed within a second through
its process sentinel, and every waiting caller gets EngineDeadError; so does every later call.
"""
import asyncio
import itertools
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core_proc import HANDSHAKE_TIMEOUT_MS, Hello, Ready, Startup
from engine.errors import EngineDeadError, EngineStateError, remote_error
from engine.protocol import (EngineCoreOutputs, EngineCoreRequest, RequestType, StreamInput, UtilityOutput,
                             UtilityRequest)
from engine.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("engine")
STARTUP_TIMEOUT_S = 600  # model conversion / loading can take a while on a cold cache
SHUTDOWN_GRACE_S = 5


class InprocClient:
    """The core in this process: calls are direct, outputs come from step()."""

    def __init__(self, config: EngineConfig):
        from engine.core import EngineCore

        self.core = EngineCore(config)
        self.num_blocks, self.max_model_len = self.core.num_blocks, self.core.max_model_len
        self._outputs: list = []

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        for req in reqs:
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
        from engine.core import Deferred

        if method.startswith("_") or not callable(getattr(self.core, method, None)):
            raise ValueError(f"the engine core has no method {method!r}")
        result = getattr(self.core, method)(*args, **kwargs)
        if isinstance(result, Deferred):  # step the core until it can answer (outputs are kept)
            while not result.done():
                if not self.core.has_work():
                    raise EngineStateError(f"{method} cannot finish: nothing in the engine can run")
                self._outputs.extend(self.core.step())
            result = result.finish()
        return result

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.core.shutdown()


class CoreProcManager:
    """Starts the engine-core process (a fresh interpreter running engine.core_proc, so the
    caller's __main__ is never re-imported), hands it its addresses and config, waits for
    READY, watches it, and shuts it down (terminate, then kill after a grace period)."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str, on_death):
        self._tmp = tempfile.mkdtemp(prefix="rollout-")
        handshake = f"ipc://{self._tmp}/handshake"
        ctx = zmq.Context.instance()
        hs = ctx.socket(zmq.ROUTER)
        hs.setsockopt(zmq.LINGER, 0)
        hs.bind(handshake)
        entry = f"from engine.core_proc import run_engine_core; run_engine_core({handshake!r}, {os.getpid()})"
        # the child imports what this process can (worker extensions, an uninstalled checkout)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-c", entry], stdin=subprocess.DEVNULL, env=env)
        self.dead = False
        self._shutting_down = False
        try:
            ident, msg = self._recv(hs, HANDSHAKE_TIMEOUT_MS, "HELLO")
            msgspec.msgpack.decode(msg, type=Hello)
            init_fields = {f: getattr(config, f) for f in config.__dataclass_fields__ if f != "model_config"}
            hs.send_multipart([ident, msgspec.msgpack.encode(Startup(input_address, output_address, init_fields))])
            _, msg = self._recv(hs, STARTUP_TIMEOUT_S * 1000, "READY")
            ready = msgspec.msgpack.decode(msg, type=Ready)
            if ready.failure:
                raise RuntimeError(f"the engine core failed to start: {ready.failure}")
            self.num_blocks, self.max_model_len = ready.num_blocks, ready.max_model_len
        except BaseException:
            self.shutdown()
            raise
        finally:
            hs.close()
        self._on_death = on_death
        threading.Thread(target=self._watch, daemon=True, name="core-monitor").start()

    def _recv(self, sock, timeout_ms: int, what: str):
        waited = 0
        while not sock.poll(min(timeout_ms - waited, 500)):
            waited += 500
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine core exited (code {self.proc.returncode}) before {what}")
            if waited >= timeout_ms:
                raise TimeoutError(f"the engine core sent no {what} within {timeout_ms / 1000:.0f} s")
        return sock.recv_multipart()

    def _watch(self) -> None:
        code = self.proc.wait()
        self.dead = True
        if not self._shutting_down:
            logger.error("the engine core process died (exit code %s)", code)
            self._on_death(f"the engine core process died (exit code {code})")

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self) -> None:
        self._shutting_down = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(SHUTDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)


class _MPClientBase:
    def __init__(self, config: EngineConfig, ctx: zmq.Context):
        self._tmpdir = tempfile.mkdtemp(prefix="rollout-io-")
        self.input_address = f"ipc://{self._tmpdir}/input"
        self.output_address = f"ipc://{self._tmpdir}/output"
        self.ctx = ctx
        self.input_socket = ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.bind(self.input_address)
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(self.output_address)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self.identity = b"core-0"
        try:
            self.manager = CoreProcManager(config, self.input_address, self.output_address, self._on_death)
        except BaseException:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            raise
        self.num_blocks, self.max_model_len = self.manager.num_blocks, self.manager.max_model_len
        weakref.finalize(self, CoreProcManager.shutdown, self.manager)
        weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        # the core's DEALER announces itself; until then the ROUTER cannot address it
        sync_view = zmq.Socket.shadow(self.input_socket.underlying)
        if not sync_view.poll(HANDSHAKE_TIMEOUT_MS):
            self.manager.shutdown()
            raise RuntimeError("the engine core did not connect its input socket")
        sync_view.recv_multipart()

    def _frames(self, kind: RequestType, obj) -> list:
        return [self.identity, kind.value, *self.encoder.encode(obj)]

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def check_health(self) -> None:
        self._check_alive()
        if self.manager.dead or not self.manager.is_alive():
            raise EngineDeadError("the engine core process is not running")


class SyncMPClient(_MPClientBase):
    """Blocking client: a background thread reads outputs into a queue; utility results are
    matched to their callers by call id."""

    def __init__(self, config: EngineConfig):
        super().__init__(config, zmq.Context())
        self.outputs: queue.Queue = queue.Queue()
        self._pending: dict[int, queue.Queue] = {}
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
            frames = sock.recv_multipart(copy=False)
            outs: EngineCoreOutputs = self.decoder.decode(frames)
            if outs.engine_dead is not None:
                self._on_death(outs.engine_dead)
                return
            if outs.utility_output is not None:
                with self._lock:
                    waiter = self._pending.pop(outs.utility_output.call_id, None)
                if waiter is not None:
                    waiter.put(outs.utility_output)
            if outs.outputs:
                self.outputs.put(outs)

    def _on_death(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self.outputs.put(None)
        with self._lock:
            pending, self._pending = self._pending, {}
        for waiter in pending.values():
            waiter.put(None)

    def _send(self, kind: RequestType, obj) -> None:
        self._check_alive()
        try:
            self.input_socket.send_multipart(self._frames(kind, obj), copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """All in one message: the core admits them together, so the first step's batch (and with
        it every result) does not depend on how fast the requests arrived."""
        self._send(RequestType.ADD_MANY, reqs)

    def add_stream_input(self, chunk: StreamInput) -> None:
        self._send(RequestType.STREAM_INPUT, chunk)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            self._send(RequestType.ABORT, list(request_ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        self._check_alive()
        outs = self.outputs.get(timeout=timeout)
        if outs is None:
            self.outputs.put(None)  # wake any other waiter too
            raise EngineDeadError(self.dead_reason)
        return outs

    def call_utility(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        call_id = next(self._call_ids)
        waiter: queue.Queue = queue.Queue()
        with self._lock:
            self._pending[call_id] = waiter
        self._send(RequestType.UTILITY, UtilityRequest(call_id, method, list(args), kwargs))
        try:
            result: UtilityOutput | None = waiter.get(timeout=timeout)
        except queue.Empty:
            with self._lock:
                self._pending.pop(call_id, None)
            raise TimeoutError(f"{method} did not answer within {timeout} s") from None
        if result is None:
            raise EngineDeadError(self.dead_reason)
        if result.failure is not None:
            raise remote_error(result.failure_type, result.failure)
        return result.result

    def shutdown(self) -> None:
        self._closed = True  # the reader closes the output socket
        self.manager.shutdown()
        self.input_socket.close(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)


class AsyncMPClient(_MPClientBase):
    """asyncio client. Outputs are read by whoever awaits get_output_async (AsyncLLM's single
    output handler); utility results resolve futures keyed by call id."""

    def __init__(self, config: EngineConfig):
        super().__init__(config, zmq.asyncio.Context())
        self._pending: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_event: asyncio.Event | None = None

    async def _ensure_ready(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._dead_event = asyncio.Event()
            if self.dead_reason is not None:
                self._dead_event.set()

    def _on_death(self, reason: str) -> None:  # from the monitor thread or the reader
        if self.dead_reason is None:
            self.dead_reason = reason
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_all)

    def _fail_all(self) -> None:
        self._dead_event.set()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(self.dead_reason))

    async def _send(self, kind: RequestType, obj) -> None:
        await self._ensure_ready()
        self._check_alive()
        try:
            await self.input_socket.send_multipart(self._frames(kind, obj), copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    async def add_request_async(self, req: EngineCoreRequest) -> None:
        await self._send(RequestType.ADD, req)

    async def add_stream_input_async(self, chunk: StreamInput) -> None:
        await self._send(RequestType.STREAM_INPUT, chunk)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            await self._send(RequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message with request outputs; raises EngineDeadError when the core is gone."""
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
            if outs.engine_dead is not None:
                self._on_death(outs.engine_dead)
                self._fail_all()
                raise EngineDeadError(outs.engine_dead)
            if outs.utility_output is not None:
                fut = self._pending.pop(outs.utility_output.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(outs.utility_output)
            if outs.outputs:
                return outs

    async def call_utility_async(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        await self._ensure_ready()
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._pending[call_id] = fut
        await self._send(RequestType.UTILITY, UtilityRequest(call_id, method, list(args), kwargs))
        try:
            result: UtilityOutput = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(call_id, None)
            raise TimeoutError(f"{method} did not answer within {timeout} s") from None
        if result.failure is not None:
            raise remote_error(result.failure_type, result.failure)
        return result.result

    def shutdown(self) -> None:
        self.manager.shutdown()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)
