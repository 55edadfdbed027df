"""Tensor-parallel collectives of one machine: gloo over loopback TCP vs ShmCommunicator.

Two processes (this one is rank 0, a spawned one rank 1), one torch thread each, as the
tensor-parallel workers run. Both hold a gloo group (`ProcessGroupGloo` on a `TCPStore`, built
the way weight_sync/group.py builds one, without init_process_group) and a ShmCommunicator
(kernels/shm_comm.py), and run the same ops back to back, in lockstep:
- all-reduce (sum, in place) of (rows, hidden) activations: hidden 576 (the default model:
  2 per layer, 30 layers per decode step) and 2048 (a bigger model), rows 1..512, float32 and
  bfloat16;
- all-gather and gather-to-rank-0 of (32, 24576) float32 (LM head vocab shards).
Each cell is the median of per-op times on rank 0 (µs); ratio = gloo / shm. Before timing, the
all-reduce results of the two backends are checked to be equal.

    python benchmarks/allreduce.py          # ~30-60 s on 2 cores
"""
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import machine_line  # noqa: E402

from kernels.shm_comm import ShmCommunicator  # noqa: E402
from weight_sync.group import find_free_port  # noqa: E402

ROWS = [1, 8, 32, 128, 512]
HIDDENS = [576, 2048]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
VOCAB_SHARD = (32, 24576)
TIMEOUT = datetime.timedelta(seconds=60)


def cases():
    """(op, shape, dtype name) in the order both ranks run them."""
    out = [("all_reduce", (r, h), d) for h in HIDDENS for d in DTYPES for r in ROWS]
    return out + [("all_gather", VOCAB_SHARD, "f32"), ("gather", VOCAB_SHARD, "f32")]


def iterations(nbytes: int) -> int:
    return 400 if nbytes <= 64 << 10 else 100 if nbytes <= 1 << 20 else 30


def gloo_group(port: int, rank: int) -> tuple[dist.ProcessGroupGloo, dist.TCPStore]:
    """The group and its store (which must outlive it)."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=TIMEOUT,
                          wait_for_workers=False)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, 2, opts), store


def gloo_op(pg, op: str, t: torch.Tensor, rank: int):
    if op == "all_reduce":
        return lambda: pg.allreduce([t]).wait()
    outs = [torch.empty_like(t) for _ in range(2)]
    if op == "all_gather":
        return lambda: pg.allgather([outs], [t]).wait()
    gopts = dist.GatherOptions()
    gopts.rootRank = 0
    return lambda: pg.gather([outs] if rank == 0 else [], [t], gopts).wait()


def shm_op(comm: ShmCommunicator, op: str, t: torch.Tensor):
    if op == "all_reduce":
        return lambda: comm.all_reduce_(t)
    if op == "all_gather":
        return lambda: comm.all_gather(t)
    return lambda: comm.gather(t, 0)


def median_us(fn, n: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def run_rank(rank: int, port: int, name: str, results=None) -> None:
    torch.set_num_threads(1)
    pg, _store = gloo_group(port, rank)
    comm = ShmCommunicator(name, rank, 2)
    g = torch.Generator().manual_seed(rank)
    try:
        for op, shape, dname in cases():
            t = torch.randn(shape, generator=g).to(DTYPES[dname])
            if op == "all_reduce":  # same answer from both backends (2 ranks: one add each)
                a, b = t.clone(), t.clone()
                pg.allreduce([a]).wait()
                comm.all_reduce_(b)
                assert torch.equal(a, b), f"gloo and shm disagree on {shape} {dname}"
            n = iterations(t.nbytes)
            comm.barrier()
            gloo_us = median_us(gloo_op(pg, op, t, rank), n)
            comm.barrier()
            shm_us = median_us(shm_op(comm, op, t), n)
            if results is not None:
                results.append((op, shape, dname, gloo_us, shm_us))
        comm.barrier()
    finally:
        comm.close()


def main() -> None:
    port, name = find_free_port(), f"bench-{os.getpid()}"
    peer = mp.get_context("spawn").Process(target=run_rank, args=(1, port, name))
    peer.start()
    results = []
    t0 = time.perf_counter()
    run_rank(0, port, name, results)
    peer.join(60)
    print(machine_line())
    print(f"torch {torch.__version__}, 2 processes x 1 torch thread; median µs per op on rank 0")
    print(f"{'op':<11} {'shape':>12} {'dtype':>5} {'gloo µs':>9} {'shm µs':>8} {'gloo/shm':>8}")
    for op, shape, dname, gloo_us, shm_us in results:
        print(f"{op:<11} {tuple(shape)!s:>12} {dname:>5} {gloo_us:>9.1f} {shm_us:>8.1f} "
              f"{gloo_us / shm_us:>8.1f}")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
