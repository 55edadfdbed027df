"""The collectives between the tensor-parallel ranks of one replica (engine.model.parallel.TPGroup).

    gloo / nccl  a stateless process group (weight_sync.WeightTransferGroup: TCP rendezvous at the
                 engine core, never torch.distributed's default group, so a worker extension or a
                 trainer in the same process keeps its own); NCCL when the ranks hold GPUs
    shm          ranks on one machine's CPUs: one shared-memory segment (kernels/shm_comm.py), no
                 socket on the step's path (benchmarks/allreduce.py measures it against gloo)

Both sum in rank order, so every rank holds the same bits after an all-reduce.
"""
import os

import msgspec
import torch

from weight_sync import WeightTransferGroup


class TPSetup(msgspec.Struct, frozen=True):
    """How the ranks of one replica find each other (chosen by rank 0, sent to the others)."""

    transport: str  # "gloo" | "nccl" | "shm"
    master_address: str  # the rendezvous (every transport forms a gloo/nccl group there first)
    master_port: int
    shm_name: str = ""
    # joining, and any one collective (a dead peer is noticed at once: closed socket, or its pid)
    timeout_s: float = 120.0


class ProcessGroupTP:
    """TPGroup over a gloo or NCCL group (one per replica; tensors on the group's device)."""

    def __init__(self, setup: TPSetup, rank: int, size: int, device: torch.device):
        self.rank, self.size = rank, size
        backend = "nccl" if setup.transport == "nccl" else "gloo"
        self.group = WeightTransferGroup(setup.master_address, setup.master_port, rank, size, backend=backend,
                                         timeout_s=setup.timeout_s, device=device if backend == "nccl" else None)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_sum_(t)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        return self.group.gather(t)

    def close(self) -> None:
        self.group.close()


class ShmTP:
    """TPGroup over one shared-memory segment (ranks of one machine, CPU tensors)."""

    def __init__(self, setup: TPSetup, rank: int, size: int):
        from kernels.shm_comm import ShmCommunicator

        self.rank, self.size = rank, size
        self.comm = ShmCommunicator(setup.shm_name, rank, size, timeout_s=setup.timeout_s)
        self.comm.barrier()  # every rank has mapped it: the name can go, so that a killed replica leaks nothing
        if rank == 0:
            try:
                os.unlink(self.comm.segment_path)
            except FileNotFoundError:
                pass

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_(t)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        out = self.comm.gather(t, 0)
        return None if out is None else list(out.chunk(self.size))

    def close(self) -> None:
        self.comm.close()


def choose_transport(device: str, dtype: torch.dtype) -> str:
    """shm for CPU ranks when the C++ kernels are here (float32 / bfloat16), else gloo; nccl on CUDA."""
    if device.startswith("cuda"):
        return "nccl"
    from kernels import cpu_ext

    return "shm" if dtype in (torch.float32, torch.bfloat16) and cpu_ext.load() is not None else "gloo"


def tp_group(setup: TPSetup, rank: int, size: int, device: torch.device):
    """Rank `rank`'s end of the replica's group; returns once every rank has joined."""
    if setup.transport == "shm":
        return ShmTP(setup, rank, size)
    return ProcessGroupTP(setup, rank, size, device)
