"""A stateless process group joining a trainer (rank 0) and engine workers (ranks 1..N) (the
tensor-parallel ranks of one engine replica also talk over one when they cannot share memory).

"Stateless": it never touches torch.distributed's default group (`init_process_group`), so a
trainer that runs its own FSDP/DDP group and an engine that runs its own tensor-parallel group
can both open one of these beside it. It is built from a `TCPStore` (hosted by rank 0) and a
backend object (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on CUDA), whose collectives we
call directly, each with the group's timeout.

Failure contract: a peer that dies or hangs turns into `WeightTransferError` on the others
within about `timeout_s` (a dead peer's closed socket is noticed at once; a hung one by gloo's
per-operation timeout). The timeout bounds each collective (one bucket), not a whole push;
`with group.deadline(seconds):` bounds every collective in the block by one overall deadline
too (each one's timeout is what is left of it), and past it raises `WeightDeadlineError`. After
such an error the group is *broken* (its sockets or communicator are in an unknown state), and
we tear it down at once so that its other peers fail fast too; every later call raises
immediately: close it and open a new one.

Traps:
- Left alone, the TCPStore master listens on *every* interface, whatever `master_address` says.
  We bind the listening socket ourselves (on `master_address` only) and hand its fd to the store,
  which then owns and closes it.
- The store has no authentication: anyone who can reach the port can join. Loopback, or a trusted
  network only.
- `find_free_port()` then binding later is racy (another process can take the port between the
  two); acceptable for tests and single-host setups, pass an explicit port otherwise.
- Gloo's `abort()` leaves its sockets open (peers then wait for the full timeout); only dropping
  the backend object closes them.
- NCCL's own `barrier()` guesses the GPU from the rank and can hang; ours is a 1-element
  all-reduce on the group's device, for both backends. The NCCL path is written against the
  same torch API but was not run here (no GPU); two ranks also cannot share one GPU.
"""
from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time

import torch
import torch.distributed as dist
from typing_extensions import Self

MASTER_POLL_S = 0.1


class WeightTransferError(RuntimeError):
    """A weight push failed: refused by a receiver, aborted by the sender, or the transport
    (peer died, timed out). The receiver's staged tensors are discarded; live weights are untouched."""


class WeightDeadlineError(WeightTransferError, TimeoutError):
    """A collective was still running when the deadline of its `group.deadline()` block passed
    (a whole push that took too long, not one slow bucket); the group is broken like after any
    transport failure."""


class WeightGroupError(WeightTransferError):
    """The group could not form: a peer never joined within the timeout, or the master address
    is unreachable. The caller's input (address, port, world size) or its trainer is at fault."""


class WeightPushRefused(WeightTransferError):
    """A push stopped before any tensor moved: a receiver refused its names, shapes or dtypes, or
    the sender aborted it. Bad input, not a transport failure: the group stays usable."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on `host` (racy by nature, see the module docstring)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _local_address_towards(master_address: str, master_port: int) -> str:
    """The local IP this host uses to reach the master (a UDP connect sends no packet).

    Gloo publishes this address to its peers; its default (the hostname's address) may be an
    interface the peers cannot reach, or a public one when everything is on loopback."""
    family, _, _, _, addr = socket.getaddrinfo(master_address, master_port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _wait_for_master(master_address: str, master_port: int, deadline: float,
                     cancel: threading.Event | None) -> None:
    """Return once the master's rendezvous port accepts connections; raise WeightGroupError at
    the deadline or when `cancel` is set. (TCPStore's own connect retries past its timeout and
    cannot be cancelled.)"""
    while True:
        if cancel is not None and cancel.is_set():
            raise WeightGroupError(f"forming the weight transfer group at {master_address}:{master_port} was "
                                   "cancelled")
        left = deadline - time.monotonic()
        if left <= 0:
            raise WeightGroupError(f"could not form the weight transfer group: nothing accepted connections at "
                                   f"{master_address}:{master_port} in time (is the trainer's rank 0 up?)")
        try:
            socket.create_connection((master_address, master_port), timeout=min(left, 0.25)).close()
            return
        except OSError:
            time.sleep(min(MASTER_POLL_S, max(left, 0.0)))


def _listen_fd(master_address: str, master_port: int) -> int:
    """A listening socket on master_address only, detached: the TCPStore takes ownership."""
    family = socket.getaddrinfo(master_address, master_port, type=socket.SOCK_STREAM)[0][0]
    try:
        sock = socket.create_server((master_address, master_port), family=family, backlog=1024)
    except OSError as e:
        raise OSError(f"cannot listen on {master_address}:{master_port} for the weight transfer group: {e}") from e
    return sock.detach()


class WeightTransferGroup:
    """Rank 0 (the trainer) hosts the TCP rendezvous; ranks 1..N (engine workers) join it.

    `backend="gloo"` moves CPU tensors over TCP, `backend="nccl"` CUDA tensors (on `device`,
    default the current CUDA device). Both take the same calls; tensors must live on
    `group.device`. The constructor blocks until all `world_size` ranks have joined (or raises
    after `timeout_s`); a joining rank gives up early when `cancel` is set while it waits for
    rank 0 to listen. With `group_name`, the group is a named torch.distributed group as SGLang,
    slime and AReaL form theirs (see _join_named).
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        device: torch.device | str | None = None,
        cancel: threading.Event | None = None,
        group_name: str | None = None,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._broken: str | None = None
        self._closed = False
        self._deadline: float | None = None  # time.monotonic() at which collectives give up (deadline())

        if backend == "nccl" and not (torch.cuda.is_available() and hasattr(dist, "ProcessGroupNCCL")):
            raise ValueError("backend 'nccl' needs CUDA and a torch built with NCCL; use 'gloo' on CPU")
        if backend == "gloo":
            self.device = torch.device("cpu")
        else:
            self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        self._store = self._pg = None
        self.group_name = group_name
        listen_fd = _listen_fd(master_address, master_port) if rank == 0 and group_name is None else None
        if rank != 0:  # joining ranks wait for the master's port first: bounded and cancellable
            _wait_for_master(master_address, master_port, time.monotonic() + timeout_s, cancel)
        if group_name is not None:
            self._join_named(master_address, master_port, group_name)
            return
        try:
            # wait_for_workers=False: the backend's rendezvous below does the waiting, with our
            # timeout. On rank 0 the store lives as long as the group (peers may still be reading
            # its keys); it carries no traffic once everyone has joined.
            self._store = dist.TCPStore(
                master_address,
                master_port,
                world_size,
                is_master=rank == 0,
                timeout=self.timeout,
                wait_for_workers=False,
                master_listen_fd=listen_fd,
            )
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = self.timeout
                local = _local_address_towards(master_address, master_port)
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
                self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, opts)
            else:
                torch.cuda.set_device(self.device)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self._pg = dist.ProcessGroupNCCL(self._store, rank, world_size, opts)
        except RuntimeError as e:  # DistStoreError / DistNetworkError / gloo connect errors
            self._release()
            raise WeightGroupError(
                f"could not form the weight transfer group at {master_address}:{master_port} as rank {rank} "
                f"of {world_size} within {timeout_s:g}s: {e}"
            ) from e
        # Returns once every rank has joined; it also connects NCCL eagerly.
        self.barrier()

    def _join_named(self, master_address: str, master_port: int, group_name: str) -> None:
        """Form the group the way torch.distributed forms a named group: a TCPStore rendezvous at
        tcp://address:port, the store prefixed with the group's name, then torch's own group
        helper. It is the recipe SGLang's init_custom_process_group uses, copied by slime and
        AReaL for their trainers, so a trainer running it meets these ranks (the store keys and
        the gloo / NCCL rendezvous must match theirs exactly). No handshake follows: that
        dialect's trainer only broadcasts."""
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

        url = f"tcp://{master_address}:{master_port}"
        try:
            store, _, _ = next(rendezvous(url, self.rank, self.world_size, timeout=self.timeout))
            store.set_timeout(self.timeout)
            self._store = PrefixStore(group_name, store)
            self._pg, _ = _new_process_group_helper(self.world_size, self.rank, [], Backend(self.backend), self._store,
                                                    group_name=group_name, timeout=self.timeout)
        except (RuntimeError, ValueError) as e:  # (ValueError: the name is taken in this process)
            self._release()
            raise WeightGroupError(f"could not join the weight group {group_name!r} at {url} as rank {self.rank} of "
                                   f"{self.world_size} within {self.timeout_s:g}s: {e}") from e

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ok")
        return f"WeightTransferGroup(rank={self.rank}/{self.world_size}, backend={self.backend}, {state})"

    # -- collectives ------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place: every rank's `tensor` (contiguous, on `self.device`) ends up equal to src's."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        """broadcast, started: the backend's own threads move the bytes while the caller packs or
        unpacks another buffer; `wait()` on the result (in the order started) before touching
        `tensor` again. Errors surface from `wait()`, as from `broadcast`."""
        assert tensor.device == self.device, f"tensor on {tensor.device}, group on {self.device}"
        assert tensor.is_contiguous(), "broadcast needs a contiguous tensor"
        return self._start("broadcast", lambda timeout: self._pg.broadcast(tensor, src, timeout))

    def all_reduce_max(self, value: int) -> int:
        """The maximum of `value` over all ranks (status handshakes: 0 = ok everywhere)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run("all_reduce", lambda timeout: self._pg.allreduce(t, dist.ReduceOp.MAX, timeout))
        return int(t.item())

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over all ranks (every rank gets the same bits); returns `tensor`."""
        def start(timeout):
            opts = dist.AllreduceOptions()
            opts.timeout = timeout
            return self._pg.allreduce([tensor], opts)

        self._run("all_reduce", start)
        return tensor

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape and dtype on all) on rank `dst`, in rank order; None elsewhere."""
        outs = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.rank == dst else []
        opts = dist.GatherOptions()
        opts.rootRank = dst

        def start(timeout):
            opts.timeout = timeout
            return self._pg.gather(outs, [tensor.contiguous()], opts)

        self._run("gather", start)
        return outs[0] if outs else None

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_counts: list[int],
                   input_counts: list[int]) -> torch.Tensor:
        """Rank r sends rows [sum(input_counts[:q]), +input_counts[q]) of `tensor` to rank q and
        receives rank q's rows for it into `output` (output_counts[q] of them, in rank order)."""
        def start(timeout):
            opts = dist.AllToAllOptions()
            opts.timeout = timeout
            return self._pg.alltoall_base(output, tensor.contiguous(), output_counts, input_counts, opts)

        self._run("all_to_all", start)
        return output

    def barrier(self) -> None:
        self.all_reduce_max(0)

    @contextlib.contextmanager
    def deadline(self, seconds: float | None):
        """Collectives inside the block give up `seconds` from now (None: no deadline), each
        with what is left as its timeout (never more than the group's own), so that a push that
        started before the deadline cannot run past it. A collective past it raises
        WeightDeadlineError and breaks the group (the peers blocked in it fail at once)."""
        before = self._deadline
        if seconds is not None:
            if not seconds > 0:
                raise ValueError(f"a deadline must be positive, got {seconds}")
            end = time.monotonic() + seconds
            self._deadline = end if before is None else min(before, end)
        try:
            yield self
        finally:
            self._deadline = before

    def abort(self, reason: str) -> None:
        """Break the group on purpose (a rank that cannot go on mid-push): its connections close,
        so peers blocked in a collective with us fail at once instead of after the timeout."""
        if not self._broken:
            self._broken = reason
        self._release()

    def close(self) -> None:
        """Release sockets / communicator and (on rank 0) the store. Idempotent."""
        self._closed = True
        self._release()

    def _release(self) -> None:
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                if getattr(self, "group_name", None) is not None:  # torch's registry frees the name too
                    dist.destroy_process_group(pg)
                else:
                    (pg.abort if self._broken else pg.shutdown)()
            except Exception:  # noqa: BLE001 - best effort on teardown, the group is gone anyway
                pass
            del pg
        self._store = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _run(self, what: str, start) -> None:
        self._start(what, start).wait()

    def _start(self, what: str, start) -> Pending:
        """start(timeout) launches the collective with that per-operation timeout; it is waited
        for as long. The timeout is the group's, or what is left of the deadline if shorter: gloo
        then ends the operation itself, so that aborting the group really closes its sockets (a
        bare wait() timeout would leave the operation, and the sockets, alive until the group's
        own timeout) and the peers blocked with us fail at once."""
        if self._closed:
            raise WeightTransferError(f"{what} on a closed {self!r}")
        if self._broken:
            raise WeightTransferError(f"{what} on a broken group (earlier error: {self._broken}); open a new one")
        timeout, by_deadline = self.timeout, False
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                self.abort(f"{what}: past the deadline")
                raise WeightDeadlineError(f"{what} on rank {self.rank}/{self.world_size}: the deadline passed "
                                          "before it started; the group was aborted")
            if left < self.timeout_s:
                timeout, by_deadline = datetime.timedelta(seconds=left), True
        try:
            work = start(timeout)
        except Exception as e:  # noqa: BLE001 - the same failure as one seen by wait()
            work = _Failed(e)
        return Pending(self, what, work, timeout, by_deadline)

    def _failed(self, what: str, e: Exception, by_deadline: bool) -> WeightTransferError:
        self.abort(f"{what} failed: {e}")
        if by_deadline and time.monotonic() >= self._deadline - 0.05:
            return WeightDeadlineError(f"{what} on rank {self.rank}/{self.world_size} did not finish before the "
                                       f"deadline; the group was aborted: {e}")
        return WeightTransferError(f"{what} failed on rank {self.rank}/{self.world_size} (peer died or did not "
                                   f"answer within {self.timeout_s:g}s): {e}")


class _Failed:
    """A collective that failed to start: its wait() raises the error."""

    def __init__(self, error: Exception):
        self.error = error

    def wait(self, timeout=None):
        raise self.error


class Pending:
    """A started collective (WeightTransferGroup.broadcast_async): `wait()` blocks until it is done,
    raising WeightTransferError (the group then aborted) as the blocking calls do."""

    __slots__ = ("group", "what", "work", "timeout", "by_deadline")

    def __init__(self, group: WeightTransferGroup, what: str, work, timeout, by_deadline: bool):
        self.group, self.what, self.work, self.timeout, self.by_deadline = group, what, work, timeout, by_deadline

    def wait(self) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        try:
            work.wait(self.timeout)
        except Exception as e:  # gloo/NCCL raise RuntimeError / DistBackendError with the cause
            raise self.group._failed(self.what, e, self.by_deadline) from e  # noqa: SLF001
