"""MultiprocExecutor: the tensor-parallel ranks of one replica.

    engine-core process                                   worker process k (k = 1..T-1)
      rank 0 Worker  <======= TP group (shm / gloo / nccl) =======>  rank k Worker
      PUSH to-k    --[STEP scheduler output | CALL | CANCEL]-->  PULL, main loop
      PULL from    <--[UtilityOutput: call id, result or failure]--  PUSH

A step: the SchedulerOutput is encoded once and the same frames go to every rank, before rank 0
runs its own forward, so all ranks meet in the step's first collective; ranks > 0 answer
nothing (only rank 0 samples: its output is the step's). A call (collective_rpc): every rank runs
the worker method, results come back in rank order; a failure on any rank raises the first one
(with its type, as engine errors cross processes). A rank forms the trainer's weight group in a
thread of its own, so that steps go on while the group forms, as with one rank.

Failure: a rank that fails a step reports it and exits. A rank that dies (killed, crashed) is
seen by a monitor thread: from then on every call raises EngineDeadError, rank 0's collectives
fail at once (a dead peer's closed socket or pid), and `on_death` (the engine-core process sets
it) ends the replica, so its callers learn it within the monitor's poll. Ranks die with the
engine-core process (engine/lifetime.py), so no orphan is left.
"""
import itertools
import logging
import os
import subprocess
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.errors import EngineDeadError, remote_error
from engine.lifetime import child_argv, child_env, die_with_parent
from engine.model.parallel import Partition
from engine.protocol import UtilityOutput
from engine.serial import MsgpackDecoder, MsgpackEncoder
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.executor import worker_method
from engine.worker.tp_group import TPSetup, choose_transport, tp_group
from engine.worker.worker import worker_class
from weight_sync.protocol import one_thread

logger = logging.getLogger("engine")

STEP, CALL, CANCEL, STOP = b"S", b"C", b"X", b"Q"
HELLO_TIMEOUT_S = 60.0  # a rank process must start (import torch) and say hello within this
READY_TIMEOUT_S = 600.0  # then load its shard
MONITOR_POLL_S = 0.2
# run beside the steps, in a thread (they wait for a trainer); True: it takes the CANCEL event
CONCURRENT_METHODS = {"init_weight_transfer": True, "receive_weights": False}


class WorkerHello(msgspec.Struct, array_like=True):
    rank: int
    pid: int


class WorkerStartup(msgspec.Struct):
    config: dict
    setup: TPSetup


def _encode(obj) -> list:
    return MsgpackEncoder().encode(obj)


class MultiprocExecutor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.size = config.tensor_parallel_size
        mc = config.model_config
        for rank in range(self.size):  # a model that cannot be split this way is refused before any rank starts
            Partition.of(mc.num_heads, mc.num_kv_heads, mc.intermediate_size, mc.vocab_size, self.size, rank)
        self.on_death: Callable[[str], None] | None = None  # the engine-core process ends the replica
        self.dead: str | None = None
        self._stopping = False
        self._ids = itertools.count(1)
        self._pending: dict[int, dict[int, Future]] = {}  # call id -> rank -> its answer
        self._lock = threading.Lock()  # the sockets to the ranks are written from the busy loop and helper threads
        base = f"ipc://@rollout-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # abstract: nothing to clean up
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(f"{base}-from")
        self.to_rank: dict[int, zmq.Socket] = {}
        for rank in range(1, self.size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"{base}-to-{rank}")
            self.to_rank[rank] = sock
        self.procs: dict[int, subprocess.Popen] = {}
        self.tp = None  # rank 0's end of the replica's group
        self._reader: threading.Thread | None = None
        self._monitor_thread: threading.Thread | None = None
        try:
            self._start(base)
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._read_results, daemon=True, name="tp-results")
        self._reader.start()
        self._monitor_thread = threading.Thread(target=self._monitor, daemon=True, name="tp-monitor")
        self._monitor_thread.start()

    # ---- start-up -------------------------------------------------------------------------
    def _start(self, base: str) -> None:
        from weight_sync import find_free_port

        env = child_env()
        for rank in range(1, self.size):
            call = (f"from engine.worker.multiproc_executor import run_worker; "
                    f"run_worker({base!r}, {os.getpid()}, {rank})")
            self.procs[rank] = subprocess.Popen(child_argv(call, os.getpid()), stdin=subprocess.DEVNULL, env=env)
        self._await(set(self.procs), HELLO_TIMEOUT_S, "start", WorkerHello)
        transport = self.config.tensor_parallel_transport
        if transport == "auto":
            transport = choose_transport(self.config.device, self.config.torch_dtype)
        setup = TPSetup(transport, "127.0.0.1", find_free_port("127.0.0.1"), shm_name=base.rpartition("@")[2])
        startup = msgspec.msgpack.encode(WorkerStartup(self.config.init_fields(), setup))
        for sock in self.to_rank.values():
            sock.send(startup)
        self.tp = tp_group(setup, 0, self.size, _device(self.config, 0))
        self.worker = worker_class(self.config.worker_extension_cls)(self.config, rank=0, tp=self.tp)
        self._await(set(self.procs), READY_TIMEOUT_S, "load the model", UtilityOutput)

    def _await(self, ranks: set[int], timeout_s: float, what: str, kind: type) -> None:
        """Read one message of `kind` from each of `ranks` (start-up only: before the reader thread);
        a failure one reports, a rank that exits, or the timeout raises."""
        decoder = MsgpackDecoder(tuple[int, kind])
        deadline = time.monotonic() + timeout_s
        while ranks:
            self._check_alive(what)
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks {sorted(ranks)} did not {what} within {timeout_s:g} s")
            if not self.results.poll(100):
                continue
            rank, msg = decoder.decode(self.results.recv_multipart())
            if isinstance(msg, UtilityOutput) and msg.failure is not None:
                raise remote_error(msg.failure_type, f"tensor-parallel rank {rank}: {msg.failure}",
                                   param=msg.failure_param)
            ranks.discard(rank)

    def _check_alive(self, what: str) -> None:
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.returncode}) during {what}")

    # ---- the executor's calls ---------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        blocks = min(self.collective_rpc("kv_cache_blocks"))
        self.collective_rpc("initialize_kv_cache", [blocks])
        return blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._check_not_dead()
        self._send_all([STEP, *_encode(scheduler_output)])
        try:
            return self.worker.execute_model(scheduler_output)
        except Exception as e:  # a peer that died mid-step is the usual cause: say so
            self._notice_death(wait_s=2.0)
            if self.dead is not None:
                raise EngineDeadError(self.dead) from e
            raise

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        fn = worker_method(self.worker, method)
        self._check_not_dead()
        kwargs = dict(kwargs or {})
        cancel = kwargs.pop("cancel", None)  # a threading.Event stays here; the ranks get CANCEL
        call_id = next(self._ids)
        answers = self._pending[call_id] = {rank: Future() for rank in self.to_rank}
        try:
            self._send_all([CALL, *_encode((call_id, method, list(args or ()), kwargs))])
            if cancel is not None:
                self._forward_cancel(cancel, answers)
            local_error, results = None, []
            try:
                results.append(fn(*(args or ()), **kwargs, **({"cancel": cancel} if cancel is not None else {})))
            except Exception as e:  # the other ranks are running it too: collect them before raising
                local_error = e
            for rank in sorted(answers):
                results.append(self._wait(answers[rank]))
            if local_error is not None:
                raise local_error
            return results
        finally:
            self._pending.pop(call_id, None)

    def _wait(self, answer: Future) -> Any:
        while True:
            try:
                out: UtilityOutput = answer.result(timeout=MONITOR_POLL_S)
                break
            except TimeoutError:
                self._check_not_dead()
        if out.failure is not None:
            raise remote_error(out.failure_type, out.failure, param=out.failure_param)
        return out.result

    def _forward_cancel(self, cancel: threading.Event, answers: dict[int, Future]) -> None:
        def watch():
            while not all(a.done() for a in answers.values()):
                if cancel.wait(MONITOR_POLL_S):
                    self._send_all([CANCEL])
                    return

        threading.Thread(target=watch, daemon=True, name="tp-cancel").start()

    def _send_all(self, frames: list) -> None:
        with self._lock:
            if self._stopping:
                raise EngineDeadError(self.dead or "the tensor-parallel ranks were shut down")
            for sock in self.to_rank.values():
                sock.send_multipart(frames, copy=False)

    # ---- answers and deaths -----------------------------------------------------------------
    def _read_results(self) -> None:
        decoder = MsgpackDecoder(tuple[int, UtilityOutput])
        while not self._stopping:
            try:
                if not self.results.poll(int(MONITOR_POLL_S * 1000)):
                    continue
                rank, out = decoder.decode(self.results.recv_multipart(copy=False))
            except zmq.ZMQError:
                return
            if out.call_id == 0:  # a failed step: the rank exits; the monitor reports its death
                logger.error("tensor-parallel rank %d failed a step: %s", rank, out.failure)
                continue
            answer = self._pending.get(out.call_id, {}).get(rank)
            if answer is not None and not answer.done():
                answer.set_result(out)

    def _monitor(self) -> None:
        while not self._stopping and self.dead is None:
            self._notice_death()
            time.sleep(MONITOR_POLL_S)

    def _notice_death(self, wait_s: float = 0.0) -> None:
        """_died() if a rank has exited (waiting up to wait_s for one to)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self.procs.items():
                if proc.poll() is not None and not self._stopping:
                    self._died(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def _died(self, why: str) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = why
        logger.error("%s: the replica is dead", why)
        for answers in list(self._pending.values()):
            for answer in answers.values():
                if not answer.done():
                    answer.set_exception(EngineDeadError(why))
        self.shutdown()
        if self.on_death is not None:
            self.on_death(why)

    def _check_not_dead(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def shutdown(self) -> None:
        """Stop the ranks (they also die with this process)."""
        if self._stopping:
            return
        self._stopping = True
        with self._lock:
            for sock in self.to_rank.values():
                try:
                    sock.send(STOP, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 2.0
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Close every socket now: a context garbage-collected with open sockets blocks forever in
        # zmq_term. The reader thread leaves its poll within MONITOR_POLL_S. Both threads are
        # joined: a daemon thread that ends after the interpreter began to exit drops the last
        # reference to this executor (its target's `self`), and freeing the model's tensors there
        # aborted the process ("terminate called without an active exception").
        for thread in (self._reader, self._monitor_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=2 * MONITOR_POLL_S + 1.0)
        with self._lock:
            self.ctx.destroy(linger=0)
        if self.tp is not None:
            self.tp.close()


def _device(config: EngineConfig, rank: int):
    import torch

    if config.device.startswith("cuda"):
        return torch.device("cuda", rank)
    return torch.device("cpu")


# ---- the rank processes ---------------------------------------------------------------------
def run_worker(base: str, parent_pid: int, rank: int) -> None:
    """Entry point of tensor-parallel rank `rank` (> 0) of an engine core's replica."""
    import signal

    import torch

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's
    logging.basicConfig(level=logging.WARNING, format=f"[tp-rank {rank}] %(levelname)s %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(f"{base}-to-{rank}")
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(f"{base}-from")
    outbox.send(msgspec.msgpack.encode((rank, WorkerHello(rank, os.getpid()))))
    startup = msgspec.msgpack.decode(inbox.recv(), type=WorkerStartup)
    try:
        config = EngineConfig(**startup.config)
        cpus = config.rank_cpus(rank)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        worker = worker_class(config.worker_extension_cls)(
            config, rank=rank, tp=tp_group(startup.setup, rank, config.tensor_parallel_size, _device(config, rank)))
    except Exception as e:
        outbox.send(msgspec.msgpack.encode((rank, UtilityOutput.failed(-1, e))))
        raise SystemExit(1) from e
    outbox.send(msgspec.msgpack.encode((rank, UtilityOutput(-1, result=True))))
    _WorkerLoop(worker, rank, ctx, base, inbox, outbox).run()


class _WorkerLoop:
    def __init__(self, worker, rank: int, ctx: zmq.Context, base: str, inbox: zmq.Socket, outbox: zmq.Socket):
        self.worker, self.rank, self.ctx, self.base = worker, rank, ctx, base
        self.inbox, self.outbox = inbox, outbox
        self.cancel = threading.Event()  # the weight group being formed beside the steps

    def run(self) -> None:
        steps = MsgpackDecoder(SchedulerOutput)
        calls = MsgpackDecoder(tuple[int, str, list, dict])
        while True:
            frames = self.inbox.recv_multipart(copy=False)
            kind = bytes(frames[0].buffer)
            if kind == STEP:
                try:
                    self.worker.execute_model(steps.decode(frames[1:]))
                except Exception as e:
                    logger.error("step failed:\n%s", traceback.format_exc())
                    self._answer(self.outbox, UtilityOutput.failed(0, e))
                    os._exit(1)
            elif kind == CALL:
                call_id, method, args, kwargs = calls.decode(frames[1:])
                if method in CONCURRENT_METHODS:
                    if CONCURRENT_METHODS[method]:
                        self.cancel = threading.Event()
                        kwargs = dict(kwargs, cancel=self.cancel)
                    threading.Thread(target=self._call_beside, args=(call_id, method, args, kwargs), daemon=True).start()
                else:
                    self._answer(self.outbox, self._call(call_id, method, args, kwargs))
            elif kind == CANCEL:
                self.cancel.set()
            elif kind == STOP:
                os._exit(0)

    def _call(self, call_id: int, method: str, args: list, kwargs: dict, **extra) -> UtilityOutput:
        try:
            return UtilityOutput(call_id, result=getattr(self.worker, method)(*args, **kwargs, **extra))
        except Exception as e:  # reported to rank 0, which raises it to the caller
            return UtilityOutput.failed(call_id, e)

    def _call_beside(self, call_id: int, method: str, args: list, kwargs: dict) -> None:
        # one thread's torch ops: a second OpenMP team beside the steps' would slow every parallel
        # region of theirs (as the engine core runs rank 0's part: EngineCore.stage_weights)
        with one_thread():
            out = self._call(call_id, method, args, kwargs)
        sock = self.ctx.socket(zmq.PUSH)  # its own socket: zmq sockets belong to one thread
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"{self.base}-from")
        self._answer(sock, out)
        sock.close()

    def _answer(self, sock: zmq.Socket, out: UtilityOutput) -> None:
        try:
            frames = _encode((self.rank, out))
        except TypeError as e:
            frames = _encode((self.rank, UtilityOutput(out.call_id, failure=f"the result cannot be sent back: {e}")))
        sock.send_multipart(frames, copy=False)
