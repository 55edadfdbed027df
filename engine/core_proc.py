"""The engine-core process: EngineCore in a busy loop, with IO threads moving ZMQ frames.

    frontend ROUTER (bind) --[type byte, payload, tensor frames]--> DEALER: input thread
        -> input queue -> busy loop: handle requests, step(), utility calls
        -> output queue -> output thread: PUSH --> frontend PULL (bind)

The IO threads do the (de)serialization, so it overlaps the forward pass (torch releases
the GIL). Startup handshake over a separate DEALER: HELLO -> {addresses, config} -> READY
{num_blocks, max_model_len} (or FAILED with the reason). The process dies with its parent
(PR_SET_PDEATHSIG, plus a parent-pid watchdog), so no orphan is ever left behind.
"""
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core import Deferred, EngineCore
from engine.errors import InvalidRequestError
from engine.protocol import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, RequestType,
                             StreamInput, UtilityOutput, UtilityRequest)
from engine.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("engine")
HANDSHAKE_TIMEOUT_MS = 30_000


class Hello(msgspec.Struct):
    pid: int


class Startup(msgspec.Struct):
    input_address: str
    output_address: str
    config: dict


class Ready(msgspec.Struct):
    num_blocks: int = 0
    max_model_len: int = 0
    failure: str = ""


def run_engine_core(handshake_address: str, parent_pid: int) -> None:
    """Entry point of the engine-core process (started by CoreProcManager)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it shuts us down
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(level=logging.WARNING, format="[engine-core] %(levelname)s %(message)s")
    ctx = zmq.Context()
    hs = ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.LINGER, 1000)
    hs.connect(handshake_address)
    hs.send(msgspec.msgpack.encode(Hello(os.getpid())))
    if not hs.poll(HANDSHAKE_TIMEOUT_MS):
        sys.exit("engine core: no startup message from the frontend")
    startup = msgspec.msgpack.decode(hs.recv(), type=Startup)
    try:
        core = EngineCore(EngineConfig(**startup.config))
    except Exception as e:  # report why, then exit: the frontend raises it
        hs.send(msgspec.msgpack.encode(Ready(failure=f"{type(e).__name__}: {e}")))
        hs.close()
        sys.exit(1)
    hs.send(msgspec.msgpack.encode(Ready(core.num_blocks, core.max_model_len)))
    hs.close()
    EngineCoreProc(core, ctx, startup.input_address, startup.output_address).run()


def _die_with_parent(parent_pid: int) -> None:
    try:  # Linux: the kernel sends SIGKILL when the parent dies
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watchdog():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            threading.Event().wait(1.0)

    threading.Thread(target=watchdog, daemon=True, name="parent-watchdog").start()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class EngineCoreProc:
    def __init__(self, core: EngineCore, ctx: zmq.Context, input_address: str, output_address: str):
        self.core = core
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.ctx = ctx
        self.input_address, self.output_address = input_address, output_address
        self.deferred: list[tuple[int, Deferred]] = []  # utility calls answered once their condition holds
        threading.Thread(target=self._input_thread, daemon=True, name="core-input").start()
        threading.Thread(target=self._output_thread, daemon=True, name="core-output").start()

    # ---- IO threads -----------------------------------------------------------------------
    def _input_thread(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"core-0")
        sock.connect(self.input_address)
        sock.send(b"")  # register our identity with the frontend's ROUTER
        decoders = {RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    RequestType.ADD_MANY: MsgpackDecoder(list[EngineCoreRequest]),
                    RequestType.STREAM_INPUT: MsgpackDecoder(StreamInput),
                    RequestType.ABORT: MsgpackDecoder(list[str]),
                    RequestType.UTILITY: MsgpackDecoder(UtilityRequest)}
        while True:
            frames = sock.recv_multipart(copy=False)
            kind = RequestType(bytes(frames[0].buffer))
            try:
                self.input_queue.put((kind, decoders[kind].decode(frames[1:])))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropping an undecodable %s message: %s", kind.name, e)

    def _output_thread(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self.output_address)
        encoder = MsgpackEncoder()
        while True:
            outputs = self.output_queue.get()
            try:
                frames = encoder.encode(outputs)
            except TypeError as e:  # a utility result that cannot travel
                u = outputs.utility_output
                assert u is not None, f"engine outputs must always encode: {e}"
                frames = encoder.encode(EngineCoreOutputs(utility_output=UtilityOutput(
                    u.call_id, failure=f"the result of the call cannot be sent back: {e}")))
            sock.send_multipart(frames, copy=False)
            if outputs.engine_dead is not None:
                sock.close()  # linger flushes the last message
                return

    # ---- busy loop --------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while True:
                if not self.core.has_work():
                    self._handle(*self.input_queue.get())  # idle: block for input
                while not self.input_queue.empty():
                    self._handle(*self.input_queue.get_nowait())
                if self.core.has_work():
                    outputs = self.core.step()
                    if outputs:
                        self.output_queue.put(EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic()))
                if self.deferred:
                    self._resolve_deferred()
        except BaseException as e:  # a bug in a step: every caller must learn it, now
            msg = f"engine core died: {type(e).__name__}: {e}"
            logger.error("%s\n%s", msg, traceback.format_exc())
            self.output_queue.put(EngineCoreOutputs(engine_dead=msg))
            threading.Event().wait(2.0)  # let the output thread flush
            os._exit(1)

    def _handle(self, kind: RequestType, msg) -> None:
        if kind in (RequestType.ADD, RequestType.ADD_MANY):
            for req in msg if kind == RequestType.ADD_MANY else [msg]:
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
            outputs = self.core.abort_requests(msg)
            if outputs:
                self.output_queue.put(EngineCoreOutputs(outputs=outputs))
        elif kind == RequestType.UTILITY:
            self._call(msg)

    def _reject(self, request_id: str, error: InvalidRequestError) -> None:
        out = EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                               error=str(error), error_type=type(error).__name__)
        self.output_queue.put(EngineCoreOutputs(outputs=[out]))

    def _call(self, req: UtilityRequest) -> None:
        fn = getattr(self.core, req.method, None) if not req.method.startswith("_") else None
        if not callable(fn):
            return self._answer(UtilityOutput(req.call_id, failure=f"the engine core has no method {req.method!r}"))
        try:
            result = fn(*req.args, **req.kwargs)
        except Exception as e:  # reported to the caller; the engine keeps serving
            return self._answer(UtilityOutput(req.call_id, failure=_message(e), failure_type=type(e).__name__))
        if isinstance(result, Deferred):
            self.deferred.append((req.call_id, result))
        else:
            self._answer(UtilityOutput(req.call_id, result=result))

    def _resolve_deferred(self) -> None:
        waiting = []
        for call_id, d in self.deferred:
            if not d.done():
                waiting.append((call_id, d))
                continue
            try:
                self._answer(UtilityOutput(call_id, result=d.finish()))
            except Exception as e:
                self._answer(UtilityOutput(call_id, failure=_message(e), failure_type=type(e).__name__))
        self.deferred = waiting

    def _answer(self, out: UtilityOutput) -> None:
        """Send a utility result, after the request outputs the call produced (an abort-mode
        pause's final outputs reach the callers before the pause returns)."""
        pending = self.core.take_pending_outputs()
        if pending:
            self.output_queue.put(EngineCoreOutputs(outputs=pending))
        self.output_queue.put(EngineCoreOutputs(utility_output=out))


def _message(e: BaseException) -> str:
    return e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
