"""The DP coordinator: one process that collects every replica's queue depth and publishes the
whole picture to every frontend (API server), so that each routes a new request to the
least-loaded replica even while other frontends are filling it.

    engine cores --PUSH EngineLoad (when it changes)--> PULL  coordinator  XPUB --DPLoads--> SUB frontends

DPLoads lists (replica index, waiting + running) for every replica heard from; it goes out
whenever a load changed (at most every PUBLISH_INTERVAL_S) and at least every HEARTBEAT_S, so a
frontend that subscribes late catches up.

No request waves. vLLM's DP coordinator also runs "waves" (START_DP_WAVE, wave_complete, dummy
batches on idle replicas) to keep replicas in lockstep, because a mixture-of-experts forward pass
with expert parallelism holds collectives across replicas (an all-to-all per MoE layer): an idle
replica must still join every step or the busy ones hang. Every architecture this engine runs
(Llama, Mistral, Qwen2, Qwen3) is dense: a replica's forward pass never talks to another, so
replicas step independently, a pause or a weight push can never meet a half-finished wave, and
there is nothing to keep in lockstep (vLLM makes the same choice for dense models).
"""
import os
import subprocess
import time

import msgspec
import zmq

from engine.lifetime import child_argv, child_env
from engine.protocol import DPLoads, EngineLoad

PUBLISH_INTERVAL_S = 0.02
HEARTBEAT_S = 1.0


class DPCoordinator:
    """Starts the coordinator process; `engine_address` (engines PUSH their loads there) and
    `frontend_address` (frontends SUBscribe there) are ipc sockets in `folder`, or TCP ports on
    `host` when engines run on other nodes."""

    def __init__(self, folder: str, host: str | None = None):
        if host is None:
            self.engine_address = f"ipc://{folder}/coordinator-in"
            self.frontend_address = f"ipc://{folder}/coordinator-out"
        else:
            from weight_sync import find_free_port

            self.engine_address = f"tcp://{host}:{find_free_port(host)}"
            self.frontend_address = f"tcp://{host}:{find_free_port(host)}"
        entry = (f"from engine.process.coordinator import run_coordinator; "
                 f"run_coordinator({self.engine_address!r}, {self.frontend_address!r}, {os.getpid()})")
        self.proc = subprocess.Popen(child_argv(entry, os.getpid()), stdin=subprocess.DEVNULL, env=child_env())

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_coordinator(engine_address: str, frontend_address: str, parent_pid: int) -> None:
    from engine.lifetime import die_with_parent

    die_with_parent(parent_pid)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(engine_address)
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(frontend_address)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(pub, zmq.POLLIN)  # subscriptions: a new frontend gets the picture at once
    decoder = msgspec.msgpack.Decoder(EngineLoad)
    loads: dict[int, int] = {}
    changed, last_sent = True, 0.0
    while True:
        timeout_ms = max(0.0, (last_sent + (PUBLISH_INTERVAL_S if changed else HEARTBEAT_S)) - time.monotonic())
        for sock, _ in poller.poll(timeout_ms * 1000):
            if sock is pull:
                load = decoder.decode(pull.recv())
                total = load.num_waiting + load.num_running
                changed = changed or loads.get(load.engine_index) != total
                loads[load.engine_index] = total
            else:
                pub.recv()  # a (un)subscription
                changed = True
        now = time.monotonic()
        if now - last_sent >= (PUBLISH_INTERVAL_S if changed else HEARTBEAT_S):
            pub.send(msgspec.msgpack.encode(DPLoads(sorted(loads.items()))))
            changed, last_sent = False, now
