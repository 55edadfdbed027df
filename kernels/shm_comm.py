"""Collectives over shared memory for the tensor-parallel ranks of one machine.

`ShmCommunicator(name, rank, world_size)` maps one POSIX shared-memory segment,
`/dev/shm/rollout-shm-<name>`, into `world_size` processes (kernels/csrc/shm_comm.cpp; the
approach of vLLM's CPU backend, csrc/cpu/shm.cpp). A decode step's all-reduces are a few KiB,
where gloo over loopback TCP spends tens of microseconds per op in the kernel and its threads;
here a call is a copy into this rank's slot, one barrier on per-rank sequence counters, and a
read of the peers' slots (benchmarks/allreduce.py measures both).

Contract:
- Every rank calls the same collectives in the same order with tensors of the same shape and
  dtype (a mismatch the segment can see, in op, dtype or size, raises RuntimeError on every rank).
- `all_reduce_` sums in rank order 0..N-1 in float32 (bfloat16 is widened, summed, rounded once)
  and every rank computes the same sum from the same inputs, so the result is bit-identical on
  every rank: tensor-parallel replicated activations stay identical.
- A peer that dies (even SIGKILL) makes the ranks waiting for it raise RuntimeError naming it
  within ~0.1-0.2 s; any wait longer than `timeout_s` raises too; a rank that raised marks the
  segment broken so that its peers raise at their next wait. After any such error the
  communicator refuses every call: close it and open a new one (the ranks' round counters no
  longer agree).
- Ranks construct in any order: rank 0 creates the segment (replacing one a dead group left
  behind), the others wait for it; the constructor returns once all ranks have joined.
- `close()`: rank 0, or the last rank out, unlinks the segment. A process that dies leaves at
  most the segment, which the next rank 0 of the same name replaces.

Traps: one caller thread per communicator (concurrent calls on one object interleave rounds);
the GIL is released while a call waits, so ranks may be threads of one process. A fork()ed
child must not use its parent's communicator (its copy's close() only unmaps); dropping the
object closes it. Tensors larger
than `slot_bytes` go through in slot-sized rounds, one barrier each. Waiting spins for ~50 us,
then yields, then sleeps 20 us at a time: ranks that wait long cost little CPU but wake
~20-70 us late.
"""
from __future__ import annotations

import re

import torch
from typing_extensions import Self

from kernels import cpu_ext

DEFAULT_SLOT_BYTES = 4 << 20  # a (512, 2048) float32 activation in one round
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class ShmCommunicator:
    """One rank's handle on the segment `name` shared by `world_size` processes of this machine."""

    def __init__(self, name: str, rank: int, world_size: int,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 60.0):
        if not _NAME.fullmatch(name):
            raise ValueError(f"name must be 1-200 characters of [A-Za-z0-9_.-], got {name!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
        if slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        ext = cpu_ext.load()
        if ext is None:
            raise RuntimeError("ShmCommunicator needs the C++ CPU kernels, which could not be built "
                               "here (see the 'kernels' log warning); use a gloo group instead")
        self.name, self.rank, self.world_size = name, rank, world_size
        self._comm = ext.ShmComm(name, rank, world_size, slot_bytes, timeout_s)

    @property
    def segment_path(self) -> str:
        """Where the segment lives while it exists: /dev/shm/rollout-shm-<name>."""
        return "/dev/shm/rollout-shm-" + self.name

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: `t` (contiguous CPU float32 / bfloat16) becomes the rank-order sum; returns it."""
        self._live().all_reduce_(t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors (contiguous, same shape everywhere) concatenated along dim 0:
        (world_size * t.shape[0], *t.shape[1:])."""
        return self._live().all_gather(t)

    def gather(self, t: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """`all_gather(t)` on rank `dst`, None on the others (which do not wait for dst's copy)."""
        return self._live().gather(t, dst)

    def barrier(self) -> None:
        self._live().barrier()

    def close(self) -> None:
        """Unmap the segment (rank 0 or the last rank out unlinks it). Idempotent."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()

    def _live(self):
        if self._comm is None:
            raise RuntimeError(f"{self!r} is closed")
        return self._comm

    def __repr__(self) -> str:
        state = "closed" if self._comm is None else "open"
        return f"ShmCommunicator({self.name!r}, rank={self.rank}/{self.world_size}, {state})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
