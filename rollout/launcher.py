"""Several API servers (`rollout serve --api-server-count K`): one launcher process, K API-server
processes accepting on one listening socket, and the engine cores they all share.

    launcher     binds the socket; starts the DP coordinator (with several replicas) and the engine
                 cores (each replica serves every API server: one input and one output socket per
                 API server); starts the K API servers, which inherit the socket; watches them
    API server k AsyncLLM attached to the engine cores (engine.protocol.EngineConnection: its
                 own sockets' addresses, client index k) behind the usual FastAPI app: a process
                 running rollout.server.run_api_server (started by name: the launcher imports
                 nothing of the server, which calls it for --api-server-count > 1)

What holds across API servers: pause, sleep and weights live in the engine cores, so a /pause
through one is seen by all (and by every replica); every API server routes to every replica; the
control routes (pause, sleep, weight updates) run one at a time across all of them (a file lock,
ServerConfig.control_lock), as within one; what routes keep between calls (LoRA adapters by name,
a vLLM-phases update under way) is one document beside that lock (rollout/api/state.py SharedState).
/metrics: the servers' own counters and histograms are aggregated with prometheus-client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, a folder of the launcher's); the engine series come
from the engine cores, the same whichever server answers. W&B is logged by API server 0 only.
An API server that dies takes the others down (the launcher stops everything and exits 1);
SIGINT / SIGTERM drain every server, then stop the engine cores. Nothing outlives the launcher.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from rollout.config import ServerConfig
from rollout.listen import banner, listen, url_of
from rollout.log import log

READY_TIMEOUT_S = 600


def run_api_servers(config: ServerConfig) -> int:
    """Serve with config.api_server_count API-server processes; returns the exit status."""
    try:
        engine_config = _engine_config(config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if engine_config.data_parallel_backend == "ray":
        print("error: several API servers with the Ray backend are not supported yet (use --data-parallel-backend mp)",
              file=sys.stderr)
        return 2
    sock = listen(config)
    sock.set_inheritable(True)
    tmp = tempfile.mkdtemp(prefix="rollout-serve-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(tmp, "prometheus")
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    procs = _Processes()
    try:
        return _serve(config, engine_config, sock, tmp, stop, procs)
    finally:
        procs.stop(config.shutdown_grace_s + 20)
        sock.close()
        shutil.rmtree(tmp, ignore_errors=True)
        log("stopped")


def _engine_config(config: ServerConfig):
    from engine.config import EngineConfig
    from engine.default_model import resolve_model
    from engine.process.managers import check_replica_count

    engine_config = EngineConfig(model=resolve_model(config.model), **config.engine_kwargs)
    check_replica_count(engine_config, engine_config.data_parallel_size)
    return engine_config


@dataclass
class _Processes:
    """What the launcher started, for run_api_servers to stop whatever happened."""

    servers: list[subprocess.Popen] = field(default_factory=list)
    manager: Any = None  # engine.process.managers.CoreEngineProcManager
    coordinator: Any = None  # engine.process.coordinator.DPCoordinator (several replicas)

    def stop(self, grace_s: float) -> None:
        _stop_servers(self.servers, grace_s)
        if self.manager is not None:
            self.manager.shutdown()
        if self.coordinator is not None:
            self.coordinator.shutdown()


def _serve(config: ServerConfig, engine_config, sock: socket.socket, tmp: str, stop: threading.Event,
           procs: _Processes) -> int:
    """Start the engine cores and the API servers (into `procs`), print the banner once all of
    them serve, and watch them until a signal or a death."""
    from engine.process.coordinator import DPCoordinator
    from engine.process.managers import CoreEngineProcManager
    from engine.protocol import EngineAddresses, EngineConnection

    k, n = config.api_server_count, engine_config.data_parallel_size
    coordinator = procs.coordinator = DPCoordinator(tmp) if n > 1 else None
    inputs = [f"ipc://{tmp}/input-{i}" for i in range(k)]
    outputs = [f"ipc://{tmp}/output-{i}" for i in range(k)]
    addresses = EngineAddresses(inputs, outputs, coordinator.engine_address if coordinator else "",
                                coordinator.waves_address if coordinator else "")
    t0 = time.perf_counter()
    log(f"loading the model into {n} engine core(s) for {k} API servers ...")
    manager = procs.manager = CoreEngineProcManager(engine_config, addresses, lambda i, why: log(f"WARNING: {why}"))
    log(f"engine cores ready in {time.perf_counter() - t0:.1f} s")
    ready_r, ready_w = os.pipe()
    for i in range(k):
        connection = EngineConnection(inputs[i], outputs[i], i, k, manager.pids(), manager.num_blocks,
                                      manager.max_model_len, coordinator.frontend_address if coordinator else "")
        procs.servers.append(_start_server(config, i, connection, sock.fileno(), ready_w, f"{tmp}/control.lock"))
    os.close(ready_w)
    if not _wait_ready(ready_r, procs.servers, stop):
        return 1
    model = config.served_model_name or Path(str(engine_config.model)).name
    print(banner(config, model, url_of(sock), engine_config, manager.max_model_len), flush=True)
    return _watch(procs.servers, stop)


def _start_server(config: ServerConfig, index: int, connection, fd: int, ready_fd: int,
                  control_lock: str) -> subprocess.Popen:
    own = replace(config, api_server_index=index, control_lock=control_lock,
                  wandb_project=config.wandb_project if index == 0 else None)
    spec = json.dumps({"config": asdict(own), "connection": msgspec.to_builtins(connection), "fd": fd,
                       "ready_fd": ready_fd, "parent": os.getpid()})
    entry = f"from rollout.server import run_api_server; run_api_server({spec!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-c", entry], pass_fds=(fd, ready_fd), env=env,
                            stdin=subprocess.DEVNULL)


def read_api_server_spec(spec_json: str):
    """In API-server process k (rollout.server.run_api_server): what _start_server handed it, as
    (config, engine connection, the inherited socket, the ready callback). It dies with the launcher."""
    from engine.lifetime import die_with_parent
    from engine.protocol import EngineConnection

    spec = json.loads(spec_json)
    die_with_parent(spec["parent"])
    config = ServerConfig(**spec["config"])
    connection = msgspec.convert(spec["connection"], EngineConnection, strict=False)

    def ready() -> None:
        os.write(spec["ready_fd"], b"r")
        os.close(spec["ready_fd"])

    return config, connection, socket.socket(fileno=spec["fd"]), ready


def _wait_ready(ready_fd: int, servers: list[subprocess.Popen], stop: threading.Event) -> bool:
    """Every API server writes one byte when it serves; False if one dies or the wait is cut short."""
    import select

    left, deadline = len(servers), time.monotonic() + READY_TIMEOUT_S
    while left:
        if stop.is_set() or time.monotonic() > deadline or any(p.poll() is not None for p in servers):
            return False
        if select.select([ready_fd], [], [], 0.2)[0]:
            left -= len(os.read(ready_fd, 64))
    os.close(ready_fd)
    return True


def _watch(servers: list[subprocess.Popen], stop: threading.Event) -> int:
    while not stop.wait(0.2):
        for i, p in enumerate(servers):
            if p.poll() is not None:
                log(f"API server {i} exited (code {p.returncode}): stopping the others")
                return 1
    return 0


def _stop_servers(servers: list[subprocess.Popen], grace_s: float) -> None:
    for p in servers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # each drains its requests, like a single server
    deadline = time.monotonic() + grace_s
    for p in servers:
        try:
            p.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
