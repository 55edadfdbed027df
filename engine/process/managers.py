"""Starting and watching engine cores (one per data-parallel replica).

    CoreEngineProcManager   local processes: fresh interpreters running engine.process.core_proc (the
                            caller's __main__ is never re-imported), handshake over ZMQ, a
                            monitor thread that reports a replica's death within ~0.2 s
    CoreEngineActorManager  Ray actors in placement groups (one per replica, any node of a Ray
                            cluster); the same busy loop inside; death seen through the actor

Handshake, per engine (its DEALER identity is its index): HELLO -> Startup {addresses, its
config with data_parallel_rank set} -> READY {num_blocks, max_model_len} or the failure. All
engines start in parallel; any failure shuts every one of them down and raises. Engines can be
added and removed later (elastic scaling) with `start` and `stop`.

An engine's index names it for the frontend's lifetime (a replacement gets a new one); its
data_parallel_rank is its slot among the live replicas when it starts (which cores it is pinned
to), and a replacement takes the slot its predecessor left. How many replicas a machine holds
(`replica_limit`, `available_memory`) is checked before any process starts.

An engine that is still starting belongs to the manager from its first instant: shutdown() (a
SIGTERM to the server) stops it and makes a running start() raise, and the child itself sets
its parent-death signal before it imports anything, so a parent that dies at any point of a
start-up leaves no process behind.
"""
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig, available_cpus
from engine.errors import EngineStartError, InvalidRequestError
from engine.lifetime import child_argv, child_env
from engine.process.core_proc import HANDSHAKE_TIMEOUT_MS
from engine.protocol import EngineAddresses, Hello, Ready, Startup

logger = logging.getLogger("engine")
STARTUP_TIMEOUT_S = 600  # model conversion / loading can take a while on a cold cache
SHUTDOWN_GRACE_S = 5
MONITOR_INTERVAL_S = 0.2


class StartCancelled(EngineStartError):
    """start() gave up because the manager is shutting down."""


def replica_config(config: EngineConfig, rank: int) -> dict:
    """The init fields of the EngineConfig of the replica in slot `rank` (what travels in the handshake)."""
    return dict(config.init_fields(), data_parallel_rank=rank)


def replica_limit(config: EngineConfig) -> tuple[int, str]:
    """How many replicas may run at once, and what sets that bound (see EngineConfig's
    max_data_parallel_size). Under Ray before the cluster is joined: no bound yet (the actors'
    placement groups wait for resources instead)."""
    if config.max_data_parallel_size is not None:
        return config.max_data_parallel_size, "max_data_parallel_size (--max-data-parallel-size)"
    on_gpu = config.device.startswith("cuda")
    tp = config.tensor_parallel_size
    gpus_each, threads = tp, (config.num_threads or 1) * tp
    if config.data_parallel_backend == "ray":
        import ray

        if not ray.is_initialized():
            return sys.maxsize, ""
        have = ray.cluster_resources()
        if on_gpu:
            return int(have.get("GPU", 0) // gpus_each), (f"the Ray cluster's {have.get('GPU', 0):g} GPU(s), "
                                                          f"{gpus_each} per replica")
        return int(have.get("CPU", 0) // threads), f"the Ray cluster's {have.get('CPU', 0):g} CPU(s), {threads} per replica"
    if on_gpu:
        import torch

        count = torch.cuda.device_count()
        return count // gpus_each, f"this machine's {count} GPU(s), {gpus_each} per replica"
    cores = len(available_cpus())
    return max(cores // threads, 1), f"this machine's {cores} CPU core(s), {threads} per replica"


def check_replica_count(config: EngineConfig, size: int) -> None:
    """InvalidRequestError (data_parallel_size) if `size` replicas are more than may run at once."""
    limit, why = replica_limit(config)
    if size > limit:
        raise InvalidRequestError(f"data_parallel_size {size} is more than this deployment holds: at most {limit} "
                                  f"({why})", "data_parallel_size")


def available_memory() -> int:
    """Bytes this process's machine (or its cgroup) can still give: MemAvailable, capped by the
    cgroup's memory.max less its current use."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    free = info.get("MemAvailable", info["MemFree"])
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            free = min(free, int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    except (OSError, ValueError):
        pass
    return free


class CoreEngineProcManager:
    def __init__(self, config: EngineConfig, addresses: EngineAddresses, on_death: Callable[[int, str], None],
                 indices: list[int] | None = None):
        self.config, self.addresses, self.on_death = config, addresses, on_death
        self.procs: dict[int, subprocess.Popen] = {}
        self._starting: dict[int, subprocess.Popen] = {}  # started, not READY yet (shutdown stops them too)
        self._reported: set[int] = set()  # deaths already reported (or expected: stop / shutdown)
        self._lock = threading.Lock()
        self._shutting_down = False
        self._tmp = tempfile.mkdtemp(prefix="rollout-")
        self.num_blocks = self.max_model_len = 0
        if config.enable_expert_parallel and config.data_parallel_size > 1 and not config.expert_parallel_address:
            from weight_sync import find_free_port

            config.expert_parallel_address = f"127.0.0.1:{find_free_port()}"  # replica 0 hosts the group
        self.start(list(range(config.data_parallel_size)) if indices is None else indices)
        threading.Thread(target=self._monitor, daemon=True, name="core-monitor").start()

    def start(self, indices: list[int], ranks: list[int] | None = None) -> None:
        """Start engines `indices` (in slots `ranks`, default their indices) and wait until every
        one is READY; or raise, leaving none of them (StartCancelled when shutdown() came first)."""
        handshake = f"ipc://{self._tmp}/handshake-{indices[0]}"
        hs = zmq.Context.instance().socket(zmq.ROUTER)
        hs.setsockopt(zmq.LINGER, 0)
        hs.bind(handshake)
        env = child_env()
        started = {}
        try:
            for i in indices:
                self._check_not_cancelled()
                entry = f"from engine.process.core_proc import run_engine_core; run_engine_core({handshake!r}, {os.getpid()}, {i})"
                with self._lock:
                    started[i] = self._starting[i] = subprocess.Popen(child_argv(entry, os.getpid()),
                                                                      stdin=subprocess.DEVNULL, env=env)
            readies = self._handshake(hs, started, dict(zip(indices, ranks or indices)))
        except BaseException:
            self._stop_procs(started.values())
            raise
        finally:
            hs.close()
            with self._lock:
                for i in started:
                    self._starting.pop(i, None)
        with self._lock:
            self.procs.update(started)
        self.num_blocks = min(r.num_blocks for r in readies)
        self.max_model_len = min(r.max_model_len for r in readies)

    def _check_not_cancelled(self) -> None:
        if self._shutting_down:
            raise StartCancelled("the engine cores' start was cancelled: shutting down")

    def _handshake(self, hs, procs: dict[int, subprocess.Popen], ranks: dict[int, int]) -> list[Ready]:
        waiting = {i.to_bytes(2, "little"): i for i in procs}
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_MS / 1000
        hello_left = set(waiting)
        readies = []
        while len(readies) < len(procs):
            self._check_not_cancelled()
            if hello_left and time.monotonic() > deadline:
                raise TimeoutError(f"engine cores {sorted(waiting[x] for x in hello_left)} sent no HELLO "
                                   f"within {HANDSHAKE_TIMEOUT_MS / 1000:.0f} s")
            if not hs.poll(200):
                for i, p in procs.items():
                    if p.poll() is not None:
                        raise EngineStartError(f"engine core {i} exited (code {p.returncode}) during start-up")
                if time.monotonic() > deadline + STARTUP_TIMEOUT_S:
                    raise TimeoutError(f"the engine cores were not ready within {STARTUP_TIMEOUT_S} s")
                continue
            ident, msg = hs.recv_multipart()
            if ident in hello_left:
                msgspec.msgpack.decode(msg, type=Hello)
                hello_left.discard(ident)
                startup = Startup(self.addresses, replica_config(self.config, ranks[waiting[ident]]))
                hs.send_multipart([ident, msgspec.msgpack.encode(startup)])
                continue
            ready = msgspec.msgpack.decode(msg, type=Ready)
            if ready.failure:
                raise EngineStartError(f"engine core {waiting[ident]} failed to start: {ready.failure}")
            readies.append(ready)
        return readies

    def _monitor(self) -> None:
        while not self._shutting_down:
            with self._lock:
                dead = [(i, p.returncode) for i, p in self.procs.items()
                        if i not in self._reported and p.poll() is not None]
                self._reported.update(i for i, _ in dead)
            for i, code in dead:
                if not self._shutting_down:
                    logger.error("engine core %d died (exit code %s)", i, code)
                    self.on_death(i, f"engine core {i} died (exit code {code})")
            time.sleep(MONITOR_INTERVAL_S)

    def is_alive(self, index: int) -> bool:
        p = self.procs.get(index)
        return p is not None and p.poll() is None

    def pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in self.procs.items()}

    def stop(self, index: int) -> None:
        """Stop one engine (scaling down); its death is expected, not reported. One still starting
        is stopped too, which makes its start() fail and stop the rest of that start."""
        with self._lock:
            self._reported.add(index)
            proc = self.procs.pop(index, None) or self._starting.get(index)
        if proc is not None:
            self._stop_procs([proc])

    def cancel_start(self) -> None:
        """Stop the engines a start() is waiting for: it raises and leaves none of them."""
        with self._lock:
            starting = list(self._starting)
        for i in starting:
            self.stop(i)

    @staticmethod
    def _stop_procs(procs) -> None:
        procs = list(procs)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def shutdown(self) -> None:
        self._shutting_down = True
        with self._lock:
            procs = [*self.procs.values(), *self._starting.values()]
        self._stop_procs(procs)
        shutil.rmtree(self._tmp, ignore_errors=True)


class EngineCoreActor:
    """An engine core inside a Ray actor. The data plane stays ZMQ (over TCP); Ray only places,
    starts and watches the process."""

    def __init__(self, fields: dict, addresses: EngineAddresses, engine_index: int):
        from engine.core.engine_core import EngineCore

        self.core = EngineCore(EngineConfig(**fields))
        self.addresses, self.engine_index = addresses, engine_index

    def ready(self) -> tuple[int, int, int]:
        return self.core.num_blocks, self.core.max_model_len, os.getpid()

    def run(self) -> None:
        """The busy loop; returns only by the process dying (its ObjectRef then errors)."""
        from engine.process.core_proc import EngineCoreProc

        EngineCoreProc(self.core, zmq.Context(), self.addresses, self.engine_index).run()


class CoreEngineActorManager:
    """Replicas as Ray actors, each in its own placement group (one bundle: the replica's CPUs,
    plus a GPU on CUDA), so Ray spreads them over the nodes of a cluster. Joins the cluster that
    RAY_ADDRESS names ("auto": the one this node belongs to, started by `ray start`), or starts a
    local one. Ray is the only cluster manager; what runs inside each actor is the same
    EngineCoreProc as in a local process. Actors die with this process (Ray kills a dead
    owner's actors)."""

    def __init__(self, config: EngineConfig, addresses: EngineAddresses, on_death: Callable[[int, str], None],
                 indices: list[int] | None = None):
        import ray

        self.config, self.addresses, self.on_death = config, addresses, on_death
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:  # the actors import what this process can
            env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            ray.init(address=os.environ.get("RAY_ADDRESS"), runtime_env={"env_vars": env}, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        self.actors: dict[int, Any] = {}
        self.groups: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}  # replica -> ObjectRef of its run(): it errors when the actor dies
        self._pids: dict[int, int] = {}
        self._starting_actors: dict[int, Any] = {}  # the actors a start() is waiting for
        self._lock = threading.Lock()
        self._shutting_down = False
        self.num_blocks = self.max_model_len = 0
        try:
            self.start(list(range(config.data_parallel_size)) if indices is None else indices)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._monitor, daemon=True, name="core-monitor").start()

    def _bundle(self) -> dict:
        bundle = {"CPU": float(self.config.num_threads or 1)}
        if self.config.device.startswith("cuda"):
            bundle["GPU"] = 1.0
        return bundle

    def start(self, indices: list[int], ranks: list[int] | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle()
        rank_of = dict(zip(indices, ranks or indices))
        actors, groups = self._starting_actors, {}
        try:
            for i in indices:
                # one bundle per tensor-parallel rank, on one node (the ranks share memory and ipc
                # sockets); the actor is rank 0 in bundle 0, its rank processes use the others'
                groups[i] = placement_group([bundle] * self.config.tensor_parallel_size, strategy="STRICT_PACK",
                                            name=f"rollout-replica-{i}-{os.getpid()}")
            ray.get([g.ready() for g in groups.values()], timeout=STARTUP_TIMEOUT_S)
            for i in indices:
                strategy = PlacementGroupSchedulingStrategy(groups[i], placement_group_bundle_index=0)
                actors[i] = ray.remote(EngineCoreActor).options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy,
                ).remote(replica_config(self.config, rank_of[i]), self.addresses, i)
            readies = dict(zip(actors, ray.get([a.ready.remote() for a in actors.values()],
                                               timeout=STARTUP_TIMEOUT_S)))
        except BaseException as e:
            for a in actors.values():
                ray.kill(a)
            _remove_groups(groups.values())
            raise EngineStartError(f"the Ray engine-core actors failed to start: {e}") from e
        finally:
            self._starting_actors = {}
        with self._lock:
            self.actors.update(actors)
            self.groups.update(groups)
            for i, actor in actors.items():
                self.runs[i] = actor.run.remote()
                self._pids[i] = readies[i][2]
        self.num_blocks = min(r[0] for r in readies.values())
        self.max_model_len = min(r[1] for r in readies.values())

    def _monitor(self) -> None:
        import ray

        while not self._shutting_down:
            with self._lock:
                refs = {ref: i for i, ref in self.runs.items()}
            if not refs:
                time.sleep(MONITOR_INTERVAL_S)
                continue
            done, _ = ray.wait(list(refs), num_returns=1, timeout=MONITOR_INTERVAL_S)
            for ref in done:
                i = refs[ref]
                with self._lock:
                    expected = self.runs.pop(i, None) is None
                if not expected and not self._shutting_down:
                    logger.error("engine core %d (Ray actor) died", i)
                    self.on_death(i, f"engine core {i} (Ray actor) died")

    def is_alive(self, index: int) -> bool:
        return index in self.runs

    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    def cancel_start(self) -> None:
        """Kill the actors a start() is waiting for: it raises and leaves none of them."""
        import ray

        for actor in list(self._starting_actors.values()):
            ray.kill(actor)

    def stop(self, index: int) -> None:
        import ray

        with self._lock:
            self.runs.pop(index, None)
            actor, group = self.actors.pop(index, None), self.groups.pop(index, None)
        if actor is not None:
            ray.kill(actor)
        _remove_groups([group] if group is not None else [])

    def shutdown(self) -> None:
        import ray

        self._shutting_down = True
        self.cancel_start()
        with self._lock:
            actors, groups = list(self.actors.values()), list(self.groups.values())
            self.actors, self.groups, self.runs = {}, {}, {}
        for a in actors:
            ray.kill(a)
        _remove_groups(groups)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def _remove_groups(groups) -> None:
    from ray.util.placement_group import remove_placement_group

    for g in groups:
        try:
            remove_placement_group(g)
        except Exception:  # noqa: BLE001 - already gone with its cluster
            pass


class EngineWatcher:
    """For a frontend that did not start the engines (an API server beside others, the engines
    started by the launcher): reports the death of engine processes it only knows by pid (pidfd:
    readable once the process exits, zombie or not)."""

    def __init__(self, pids: dict[int, int], on_death: Callable[[int, str], None]):
        self._pids, self.on_death = dict(pids), on_death
        self._fds = {os.pidfd_open(pid): i for i, pid in self._pids.items()}
        self._dead: set[int] = set()
        self._shutting_down = False
        threading.Thread(target=self._monitor, daemon=True, name="core-monitor").start()

    def _monitor(self) -> None:
        import select

        while self._fds and not self._shutting_down:
            ready, _, _ = select.select(list(self._fds), [], [], 1.0)
            for fd in ready:
                i = self._fds.pop(fd)
                os.close(fd)
                self._dead.add(i)
                if not self._shutting_down:
                    self.on_death(i, f"engine core {i} died")

    def is_alive(self, index: int) -> bool:
        return index in self._pids and index not in self._dead

    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    def shutdown(self) -> None:
        self._shutting_down = True  # the launcher stops the engines
