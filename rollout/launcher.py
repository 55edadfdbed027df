"""Several API servers (`rollout serve --api-server-count K`): one launcher process, K API-server
processes accepting on one listening socket, and the engine cores they all share.

    launcher     binds the socket; starts the DP coordinator (with several replicas) and the engine
                 cores (each replica serves every API server: one input and one output socket per
                 API server); starts the K API servers, which inherit the socket; watches them
    API server k AsyncLLM attached to the engine cores (engine.protocol.EngineConnection: its
                 own sockets' addresses, client index k) behind the usual FastAPI app

What holds across API servers: pause, sleep and weights live in the engine cores, so a /pause
through one is seen by all (and by every replica); every API server routes to every replica.
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
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace

import msgspec

from rollout.config import ServerConfig
from rollout.server import _log, listen, url_of

READY_TIMEOUT_S = 600


def run_api_servers(config: ServerConfig) -> int:
    from engine.config import EngineConfig
    from engine.default_model import resolve_model
    from engine.process.coordinator import DPCoordinator
    from engine.process.managers import CoreEngineProcManager, check_replica_count
    from engine.protocol import EngineAddresses, EngineConnection

    k = config.api_server_count
    try:
        engine_config = EngineConfig(model=resolve_model(config.model), **config.engine_kwargs)
        check_replica_count(engine_config, engine_config.data_parallel_size)
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
    coordinator = manager = None
    servers: list[subprocess.Popen] = []
    code = 0
    try:
        n = engine_config.data_parallel_size
        coordinator = DPCoordinator(tmp) if n > 1 else None
        inputs = [f"ipc://{tmp}/input-{i}" for i in range(k)]
        outputs = [f"ipc://{tmp}/output-{i}" for i in range(k)]
        addresses = EngineAddresses(inputs, outputs, coordinator.engine_address if coordinator else "")
        t0 = time.perf_counter()
        _log(f"loading the model into {n} engine core(s) for {k} API servers ...")
        manager = CoreEngineProcManager(engine_config, addresses, lambda i, why: _log(f"WARNING: {why}"))
        _log(f"engine cores ready in {time.perf_counter() - t0:.1f} s")
        ready_r, ready_w = os.pipe()
        for i in range(k):
            connection = EngineConnection(inputs[i], outputs[i], i, k, manager.pids(), manager.num_blocks,
                                          manager.max_model_len, coordinator.frontend_address if coordinator else "")
            servers.append(_start_server(config, i, connection, sock.fileno(), ready_w))
        os.close(ready_w)
        if not _wait_ready(ready_r, servers, stop):
            code = 1
        else:
            auth = " (API key required)" if config.api_key else ""
            print(f"[rollout] serving on {url_of(sock)}{auth} ({k} API servers, {n} engine core(s))", flush=True)
            code = _watch(servers, stop)
    finally:
        _stop_servers(servers, config.shutdown_grace_s + 20)
        if manager is not None:
            manager.shutdown()
        if coordinator is not None:
            coordinator.shutdown()
        sock.close()
        shutil.rmtree(tmp, ignore_errors=True)
        _log("stopped")
    return code


def _start_server(config: ServerConfig, index: int, connection, fd: int, ready_fd: int) -> subprocess.Popen:
    own = replace(config, api_server_index=index, wandb_project=config.wandb_project if index == 0 else None)
    spec = json.dumps({"config": asdict(own), "connection": msgspec.to_builtins(connection), "fd": fd,
                       "ready_fd": ready_fd, "parent": os.getpid()})
    entry = f"from rollout.launcher import run_api_server; run_api_server({spec!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-c", entry], pass_fds=(fd, ready_fd), env=env,
                            stdin=subprocess.DEVNULL)


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
                _log(f"API server {i} exited (code {p.returncode}): stopping the others")
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


def run_api_server(spec_json: str) -> None:
    """Entry point of API-server process k (started by the launcher)."""
    import asyncio
    import logging
    import socket

    from engine.process.core_proc import die_with_parent
    from engine.protocol import EngineConnection
    from rollout.server import serve

    spec = json.loads(spec_json)
    die_with_parent(spec["parent"])
    config = ServerConfig(**spec["config"])
    connection = msgspec.convert(spec["connection"], EngineConnection, strict=False)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s api-server-{config.api_server_index}: %(message)s")
    sock = socket.socket(fileno=spec["fd"])

    def ready() -> None:
        os.write(spec["ready_fd"], b"r")
        os.close(spec["ready_fd"])

    try:
        asyncio.run(serve(config, sock=sock, connection=connection, on_ready=ready))
    except KeyboardInterrupt:
        pass
    finally:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())
