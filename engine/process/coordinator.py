"""The DP coordinator: one process that collects every replica's queue depth and publishes the
whole picture to every frontend (API server), so that each routes a new request to the
least-loaded replica even while other frontends are filling it.

    engine cores --PUSH EngineLoad (when it changes)--> PULL  coordinator  XPUB --DPLoads--> SUB frontends

DPLoads lists (replica index, waiting + running) for every replica heard from; it goes out
whenever a load changed (at most every PUBLISH_INTERVAL_S) and at least every HEARTBEAT_S, so a
frontend that subscribes late catches up.

Request waves, for expert parallelism only (engine/process/waves.py): a replica that enters a
wave with work of its own reports it (WaveEvent started), and the coordinator publishes the wave
number to every engine on a second socket (`waves_address`), again every WAVE_REPEAT_S while the
wave runs (a subscriber that joined late still hears it), until replica 0 reports the wave
complete. Dense replicas never talk to each other in a step and run no waves.
"""
import os
import subprocess
import time

import msgspec
import zmq

from engine.lifetime import child_argv, child_env
from engine.protocol import DPLoads, EngineLoad, WaveEvent

PUBLISH_INTERVAL_S = 0.02
HEARTBEAT_S = 1.0
WAVE_REPEAT_S = 0.2


class DPCoordinator:
    """Starts the coordinator process; `engine_address` (engines PUSH their loads there) and
    `frontend_address` (frontends SUBscribe there) are ipc sockets in `folder`, or TCP ports on
    `host` when engines run on other nodes."""

    def __init__(self, folder: str, host: str | None = None):
        if host is None:
            self.engine_address = f"ipc://{folder}/coordinator-in"
            self.frontend_address = f"ipc://{folder}/coordinator-out"
            self.waves_address = f"ipc://{folder}/coordinator-waves"
        else:
            from weight_sync import find_free_port

            self.engine_address = f"tcp://{host}:{find_free_port(host)}"
            self.frontend_address = f"tcp://{host}:{find_free_port(host)}"
            self.waves_address = f"tcp://{host}:{find_free_port(host)}"
        entry = (f"from engine.process.coordinator import run_coordinator; "
                 f"run_coordinator({self.engine_address!r}, {self.frontend_address!r}, {self.waves_address!r}, "
                 f"{os.getpid()})")
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


def run_coordinator(engine_address: str, frontend_address: str, waves_address: str, parent_pid: int) -> None:
    from engine.lifetime import die_with_parent

    die_with_parent(parent_pid)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(engine_address)
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(frontend_address)
    waves = ctx.socket(zmq.PUB)
    waves.setsockopt(zmq.LINGER, 0)
    waves.bind(waves_address)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(pub, zmq.POLLIN)  # subscriptions: a new frontend gets the picture at once
    decoder = msgspec.msgpack.Decoder(EngineLoad | WaveEvent)
    loads: dict[int, int] = {}
    changed, last_sent = True, 0.0
    wave, wave_running, wave_sent = 0, False, 0.0  # the wave engines must join, while one runs
    while True:
        due = last_sent + (PUBLISH_INTERVAL_S if changed else HEARTBEAT_S)
        if wave_running:
            due = min(due, wave_sent + WAVE_REPEAT_S)
        for sock, _ in poller.poll(max(0.0, due - time.monotonic()) * 1000):
            if sock is pull:
                msg = decoder.decode(pull.recv())
                if isinstance(msg, WaveEvent):
                    if msg.started and msg.wave >= wave:
                        wave, wave_running, wave_sent = msg.wave, True, 0.0
                    elif not msg.started and msg.wave >= wave:
                        wave, wave_running = msg.wave + 1, False
                    continue
                total = msg.num_waiting + msg.num_running
                changed = changed or loads.get(msg.engine_index) != total
                loads[msg.engine_index] = total
            else:
                pub.recv()  # a (un)subscription
                changed = True
        now = time.monotonic()
        if wave_running and now - wave_sent >= WAVE_REPEAT_S:
            waves.send(msgspec.msgpack.encode(wave))
            wave_sent = now
        if now - last_sent >= (PUBLISH_INTERVAL_S if changed else HEARTBEAT_S):
            pub.send(msgspec.msgpack.encode(DPLoads(sorted(loads.items()))))
            changed, last_sent = False, now
