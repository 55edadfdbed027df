"""ShmCommunicator (kernels/shm_comm.py) across real processes: spawned ranks run `_ranks_main`
or `_hold_main` and report through a queue; the pytest process checks the reports and, for the
failure tests, kills ranks with SIGKILL or is a rank itself.

Exactness: every all-reduce must equal, bit for bit, the float32 sum in rank order
(`rank_order_sum`) on every rank; inputs are seeded per (case, rank), so each process rebuilds
everyone's inputs and checks itself, and the parent compares the ranks' result digests.
"""
import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

import pytest
import torch

from kernels.shm_comm import ShmCommunicator

CTX = mp.get_context("spawn")
SLOT = 64 << 10  # small slots: the big cases take several rounds
WAIT_S = 120.0  # spawned ranks import torch first; a hang fails the test instead of the suite
REDUCE_CASES = [  # (label, shape, dtype)
    ("f32 1x576", (1, 576), torch.float32),
    ("f32 37x19", (37, 19), torch.float32),
    ("bf16 8x576", (8, 576), torch.bfloat16),
    ("f32 300x576 (11 rounds)", (300, 576), torch.float32),
    ("bf16 123x1001 (4 rounds, ragged)", (123, 1001), torch.bfloat16),
    ("f32 empty", (0, 576), torch.float32),
]
NUM_TINY = 3000


def make_input(label: str, rank: int, shape, dtype) -> torch.Tensor:
    """Seeded per (label, rank); magnitudes from 1e-3 to 1e3, so the summation order shows."""
    g = torch.Generator().manual_seed(int(hashlib.sha256(f"{label}/{rank}".encode()).hexdigest()[:8], 16))
    scale = 10.0 ** torch.randint(-3, 4, shape, generator=g)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = xs[0].float().clone()
    for x in xs[1:]:
        acc += x.float()
    return acc.to(xs[0].dtype)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tiny_calls(comm: ShmCommunicator, rank: int, world_size: int) -> str:
    """Thousands of small mixed calls whose results change every call: a slot read one round
    early or late shows up as a wrong value."""
    for i in range(NUM_TINY):
        kind = i % 4
        if kind == 0:
            t = torch.full((1 + i % 5,), float(i * world_size + rank))
            comm.all_reduce_(t)
            want = float(sum(i * world_size + r for r in range(world_size)))
            if not bool((t == want).all()):
                return f"call {i}: all_reduce_ gave {t.tolist()}, want {want}"
        elif kind == 1:
            got = comm.all_gather(torch.tensor([[i, rank]])).tolist()
            if got != [[i, r] for r in range(world_size)]:
                return f"call {i}: all_gather gave {got}"
        elif kind == 2:
            comm.barrier()
        else:
            dst = i % world_size
            got = comm.gather(torch.tensor([i + rank], dtype=torch.int32), dst)
            want = None if rank != dst else [i + r for r in range(world_size)]
            if (got if got is None else got.tolist()) != want:
                return f"call {i}: gather to {dst} gave {got}"
    return "ok"


def _spawned(main, *args) -> None:
    torch.set_num_threads(1)  # as the tensor-parallel workers run
    main(*args)


def _ranks_main(name: str, rank: int, world_size: int, queue) -> None:
    report = {}
    try:
        with ShmCommunicator(name, rank, world_size, slot_bytes=SLOT, timeout_s=30.0) as comm:
            for label, shape, dtype in REDUCE_CASES:
                x = make_input(label, rank, shape, dtype)
                assert comm.all_reduce_(x) is x
                want = rank_order_sum([make_input(label, r, shape, dtype) for r in range(world_size)])
                report[label] = (bits(x) == bits(want), hashlib.sha256(bits(x)).hexdigest())
            parts = [make_input("gather", r, (5, 7001), torch.float32) for r in range(world_size)]
            got = comm.all_gather(parts[rank])  # 140 KB a rank: 3 rounds
            report["all_gather"] = (bits(got) == bits(torch.cat(parts)), "")
            got = comm.gather(parts[rank], world_size - 1)
            want_none = rank != world_size - 1
            report["gather"] = ((got is None) if want_none else bits(got) == bits(torch.cat(parts)), "")
            report["tiny"] = (_tiny_calls(comm, rank, world_size), "")
            try:  # ranks disagree on the size: every rank must raise, not mix the data
                comm.all_reduce_(torch.zeros(10 + rank))
                report["mismatch"] = ("no error", "")
            except RuntimeError as e:
                report["mismatch"] = (str(e), "")
        queue.put((rank, report, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, report, traceback.format_exc()))


def _hold_main(name: str, rank: int, world_size: int, go_path: str, queue) -> None:
    """Joins, does one all-reduce, reports ready; then waits for the file `go_path` (the parent
    kills a rank meanwhile) and reports how its next all-reduce and the call after it ended.
    (Not an mp.Event: its set() waits for every waiter to wake, a killed one never does.)"""
    try:
        with ShmCommunicator(name, rank, world_size, timeout_s=30.0) as comm:
            comm.all_reduce_(torch.ones(4))
            queue.put((rank, "ready", None))
            deadline = time.monotonic() + WAIT_S
            while not os.path.exists(go_path) and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            try:
                comm.all_reduce_(torch.ones(4))
                first = "no error"
            except RuntimeError as e:
                first = str(e)
            elapsed = time.monotonic() - t0
            try:
                comm.barrier()
                later = "no error"
            except RuntimeError as e:
                later = str(e)
        queue.put((rank, (first, elapsed, later), None))
    except BaseException:  # noqa: BLE001
        queue.put((rank, None, traceback.format_exc()))


def collect(queue, num: int) -> dict:
    out = {}
    deadline = time.monotonic() + WAIT_S
    while len(out) < num:
        rank, result, error = queue.get(timeout=max(deadline - time.monotonic(), 0.1))
        assert error is None, f"rank {rank} failed:\n{error}"
        out[rank] = result
    return out


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)


def segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/rollout-shm-{name}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_exact_and_identical_on_every_rank(ext, procs, world_size):
    name = f"test-{os.getpid()}-{world_size}"
    queue = CTX.Queue()
    for rank in range(world_size):
        procs.append(CTX.Process(target=_spawned, args=(_ranks_main, name, rank, world_size, queue)))
        procs[-1].start()
    reports = collect(queue, world_size)
    for label, _, _ in REDUCE_CASES:
        results = [reports[r][label] for r in range(world_size)]
        assert all(ok for ok, _ in results), f"{label}: not the rank-order float32 sum: {results}"
        assert len({digest for _, digest in results}) == 1, f"{label}: ranks differ"
    for rank, report in reports.items():
        assert report["all_gather"][0] and report["gather"][0], f"rank {rank}: {report}"
        assert report["tiny"][0] == "ok", f"rank {rank}: {report['tiny'][0]}"
        # (a slower rank may raise "rank N broke the group (<N's error>)" instead)
        assert "collective mismatch" in report["mismatch"][0], report["mismatch"][0]
    for p in procs:
        p.join(10)
    assert not segment_exists(name), "close() left the segment behind"


def test_killed_peer_raises_on_the_others(ext, procs, tmp_path):
    """Rank 2 of 3 is SIGKILLed and left unreaped (a zombie, which kill(pid, 0) still finds)."""
    name = f"test-{os.getpid()}-kill"
    queue, go = CTX.Queue(), tmp_path / "go"
    for rank in range(3):
        procs.append(CTX.Process(target=_spawned, args=(_hold_main, name, rank, 3, str(go), queue)))
        procs[-1].start()
    assert collect(queue, 3) == {0: "ready", 1: "ready", 2: "ready"}
    time.sleep(0.2)  # let rank 2's queue thread release the queue's lock, which the others need
    os.kill(procs[2].pid, signal.SIGKILL)
    go.touch()
    results = collect(queue, 2)
    for rank, (first, elapsed, later) in results.items():
        assert "rank 2" in first and "died" in first, f"rank {rank}: {first}"
        assert elapsed < 3.0, f"rank {rank} took {elapsed:.1f} s to notice"
        assert "broken communicator" in later, f"rank {rank}: {later}"
    procs[0].join(10)
    assert not segment_exists(name), "rank 0's close() must unlink the segment"


def test_segment_of_a_dead_rank0_is_replaced(ext, procs, tmp_path):
    """Rank 0 dies: its segment stays behind. A new group of the same name, whose rank 1 starts
    first (it must not join the dead group's segment), replaces it and cleans up."""
    name = f"test-{os.getpid()}-stale"
    queue, go = CTX.Queue(), tmp_path / "go"
    for rank in range(2):
        procs.append(CTX.Process(target=_spawned, args=(_hold_main, name, rank, 2, str(go), queue)))
        procs[-1].start()
    collect(queue, 2)
    time.sleep(0.2)
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(10)  # reaped this time: the pid is gone
    go.touch()
    first, _, _ = collect(queue, 1)[1]
    assert "rank 0" in first and "died" in first, first
    assert segment_exists(name), "the dead rank 0 could not have unlinked it"

    # The new rank 1 is a thread of this process, polling before the new rank 0 even starts.
    queue = CTX.Queue()
    rank1 = threading.Thread(target=_ranks_main, args=(name, 1, 2, queue))
    rank1.start()
    procs.append(CTX.Process(target=_spawned, args=(_ranks_main, name, 0, 2, queue)))
    procs[-1].start()
    reports = collect(queue, 2)
    rank1.join(10)
    for rank, report in reports.items():
        assert all(report[label][0] for label, _, _ in REDUCE_CASES), f"rank {rank}: {report}"
        assert report["tiny"][0] == "ok", report["tiny"]
    procs[-1].join(10)
    assert not segment_exists(name)


def test_timeout_when_a_rank_never_joins(ext):
    name = f"test-{os.getpid()}-timeout"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.5 s waiting for rank 1"):
        ShmCommunicator(name, 0, 2, timeout_s=0.5)
    assert time.monotonic() - t0 < 3.0
    assert not segment_exists(name), "a failed join must unlink rank 0's segment"
    with pytest.raises(RuntimeError, match="waiting for rank 0 to create"):
        ShmCommunicator(name, 1, 2, timeout_s=0.3)


def test_one_rank_and_argument_checks(ext):
    name = f"test-{os.getpid()}-solo"
    with ShmCommunicator(name, 0, 1, slot_bytes=4096) as comm:
        x = make_input("solo", 0, (100, 33), torch.bfloat16)
        want = x.clone()
        comm.all_reduce_(x)
        assert bits(x) == bits(want)
        assert torch.equal(comm.all_gather(x), x) and torch.equal(comm.gather(x, 0), x)
        comm.barrier()
        with pytest.raises(RuntimeError, match="contiguous"):
            comm.all_reduce_(torch.zeros(4, 4).t())
        with pytest.raises(RuntimeError, match="float32 or bfloat16"):
            comm.all_reduce_(torch.zeros(4, dtype=torch.int64))
        comm.barrier()  # bad arguments are refused before any round: the group stays usable
    assert not segment_exists(name)
    with pytest.raises(RuntimeError, match="closed"):
        comm.barrier()
    with pytest.raises(ValueError, match="outside"):
        ShmCommunicator(name, 2, 2)
    with pytest.raises(ValueError, match="name"):
        ShmCommunicator("a/b", 0, 1)
