"""Weight push over a real gloo group: real processes talking TCP on 127.0.0.1, no mocks.

The pytest process is usually the trainer (rank 0, the sender); engine workers are spawned
processes running `_receiver_main`, which report each push's outcome through a queue. The
model both sides agree on is `make_tensors()` (seeded, so every process builds the same one).
"""
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.weight_sync.partial_push import send_first_bucket_only, send_some_buckets
from weight_sync import (
    SharedWeights,
    WeightDeadlineError,
    WeightReceiver,
    WeightSender,
    WeightTransferError,
    WeightTransferGroup,
    find_free_port,
    load_safetensors_folder,
    read_shared,
    weights_checksum,
)
from weight_sync.protocol import (
    ALIGN,
    GLOO_MAX_BUCKET_BYTES,
    PushHeader,
    TensorMeta,
    _copy,
    one_thread,
    check_header,
    plan_buckets,
)

CTX = mp.get_context("spawn")
BUCKET = 300_000  # forces many buckets, and cuts lm_head (4 MiB) into pieces
TIMEOUT_S = 30.0  # rendezvous waits for spawned processes to import torch


def make_tensors() -> dict[str, torch.Tensor]:
    """A small Llama-like model: fp32 and bf16 mixed, ~7 MB, a scalar and a tensor > BUCKET."""
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(512, 256, generator=g)}
    for i in range(3):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(256, 256, generator=g).bfloat16()
        t[p + "mlp.up_proj.weight"] = torch.randn(512, 256, generator=g).bfloat16()
        t[p + "input_layernorm.weight"] = torch.randn(256, generator=g)
        t[p + "mlp.down_proj.weight"] = torch.randn(256, 512, generator=g)
    t["model.norm.weight"] = torch.randn(256, generator=g).bfloat16()
    t["model.logit_scale"] = torch.tensor(0.5)
    t["lm_head.weight"] = torch.randn(1024, 1024, generator=g)
    return t


def expected_of(tensors, cast=None, drop=()):
    return {
        n: (tuple(t.shape), cast if cast is not None and t.is_floating_point() else t.dtype)
        for n, t in tensors.items()
        if n not in drop
    }


def _receiver_main(port, rank, world_size, pushes, results):
    """An engine worker: one `receive()` per entry of `pushes` ({"cast": dtype, "drop": names})."""
    group = WeightTransferGroup("127.0.0.1", port, rank, world_size, timeout_s=TIMEOUT_S)
    receiver = WeightReceiver(group)
    model = make_tensors()
    staging = None  # with push["into"]: one set of tensors every such push is received into
    for push in pushes:
        cast = push.get("cast")
        expected = expected_of(model, cast, push.get("drop", ()))
        if push.get("into") and staging is None:
            staging = {n: torch.full(shape, 7).to(dtype) for n, (shape, dtype) in expected.items()}
        t0 = time.perf_counter()
        try:
            got = receiver.receive(expected, into=staging.__getitem__ if push.get("into") else None)
        except WeightTransferError as e:
            results.put({"rank": rank, "ok": False, "error": str(e), "seconds": time.perf_counter() - t0})
            continue
        scale = push.get("scale", 1)
        equal = all(
            t.dtype == expected[n][1] and torch.equal(t, (model[n] * scale).to(expected[n][1])) for n, t in got.items()
        )
        results.put({
            "rank": rank,
            "ok": True,
            "names": sorted(got),
            "equal": equal,
            "into": bool(push.get("into")) and all(t.data_ptr() == staging[n].data_ptr() for n, t in got.items()),
            "aligned": all(t.data_ptr() % 64 == 0 for t in got.values()),
            "checksum": weights_checksum(got.items()),
            "stats": receiver.last_stats,
        })
    group.close()


@contextmanager
def engine_workers(pushes, num_workers=1, timeout_s=TIMEOUT_S):
    """Spawn receivers (ranks 1..N); yields (rank-0 group, results queue); checks clean exits."""
    port = find_free_port()
    results = CTX.Queue()
    procs = [
        CTX.Process(target=_receiver_main, args=(port, r, num_workers + 1, pushes, results), daemon=True)
        for r in range(1, num_workers + 1)
    ]
    for p in procs:
        p.start()
    group = None
    try:
        group = WeightTransferGroup("127.0.0.1", port, 0, num_workers + 1, timeout_s=timeout_s)
        yield group, results
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [0] * num_workers
    finally:
        if group is not None:
            group.close()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def next_results(results, n=1):
    out = [results.get(timeout=30) for _ in range(n)]
    return sorted(out, key=lambda r: r["rank"])


# -- two and three processes -------------------------------------------------------------------


def test_push_roundtrip_bit_exact():
    model = make_tensors()
    with engine_workers([{}, {"cast": torch.bfloat16}, {}]) as (group, results):
        sender = WeightSender(group, bucket_bytes=BUCKET)
        stats = sender.send(model.items())
        (r,) = next_results(results)
        assert r["ok"], r
        assert r["names"] == sorted(model) and r["equal"] and r["aligned"]
        assert r["checksum"] == weights_checksum(model.items())
        assert stats["num_tensors"] == len(model)
        assert stats["num_bytes"] == sum(t.numel() * t.element_size() for t in model.values())
        assert stats["num_buckets"] > 10  # packed buckets + pieces of lm_head
        assert r["stats"]["num_bytes"] == stats["num_bytes"]

        # the trainer keeps fp32 weights and casts on the fly for a bf16 engine
        fp32 = {n: t.float() for n, t in model.items()}
        sender.send(fp32.items(), dtype=torch.bfloat16)
        (r,) = next_results(results)
        assert r["ok"] and r["equal"], r
        assert r["checksum"] == weights_checksum(fp32.items(), dtype=torch.bfloat16)
        assert r["checksum"] != weights_checksum(fp32.items())

        # non-contiguous views (a transposed layout) take the copying paths, packed and in pieces
        strided = {n: t.t().contiguous().t() if t.dim() == 2 else t for n, t in model.items()}
        assert not strided["lm_head.weight"].is_contiguous()
        sender.send(strided.items())
        (r,) = next_results(results)
        assert r["ok"] and r["equal"] and r["checksum"] == weights_checksum(model.items()), r


def test_push_into_the_callers_staging_memory():
    """`receive(into=)`: every tensor lands in the caller's own (reused) staging tensors, packed
    buckets and pieces of large ones alike, push after push; the sender's buckets are pipelined."""
    model = make_tensors()
    with engine_workers([{"into": True}, {"into": True, "scale": 3}]) as (group, results):
        sender = WeightSender(group, bucket_bytes=BUCKET)
        for scale in (1, 3):
            sender.send(((n, t * scale) for n, t in model.items()))
            (r,) = next_results(results)
            assert r["ok"] and r["equal"] and r["into"] and r["names"] == sorted(model), r


def test_a_writer_stages_the_tensors_it_takes_and_the_rest_are_copied():
    """`receive(write=)`: each tensor, whole, goes to the writer (from its bucket, or from `into`
    where a large one's pieces landed); what it returns stands for the tensor, and a None has it
    copied into `into` as usual. The writer runs on one thread, and the caller's thread count is
    back after. Both ranks in this process, the trainer on a thread."""
    import threading

    model = make_tensors()
    assert any(t.numel() * t.element_size() > BUCKET for t in model.values())  # (pieces go through it too)
    taken = sorted(model)[::2]
    port = find_free_port()

    def trainer():
        with WeightTransferGroup("127.0.0.1", port, 0, 2, timeout_s=TIMEOUT_S) as group:
            WeightSender(group, bucket_bytes=BUCKET).send(model.items())

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    threads, seen = torch.get_num_threads(), {}

    def write(name, t):
        seen[name] = torch.get_num_threads()
        return -t if name in taken else None  # (a stand-in for another layout: the engine's packed panels)

    with WeightTransferGroup("127.0.0.1", port, 1, 2, timeout_s=TIMEOUT_S) as group:
        staging = {n: torch.zeros_like(t) for n, t in model.items()}
        got = WeightReceiver(group).receive(expected_of(model), into=staging.__getitem__, write=write)
    thread.join(timeout=30)
    assert sorted(seen) == sorted(model) and set(seen.values()) == {1}
    assert torch.get_num_threads() == threads
    for name, t in model.items():
        if name in taken:
            assert torch.equal(got[name], -t), name
        else:
            assert got[name] is staging[name] and torch.equal(got[name], t), name


def test_the_receiver_keeps_its_bucket_buffers_from_push_to_push():
    """Buckets of one push differ in size (a dtype's last one is short); each buffer goes back
    whole, so the second and third pushes receive into the first one's buffers (fresh memory costs
    page faults worth several copies). Both ranks in this process, the trainer on a thread."""
    import threading

    model = make_tensors()
    port = find_free_port()

    def trainer():
        with WeightTransferGroup("127.0.0.1", port, 0, 2, timeout_s=TIMEOUT_S) as group:
            sender = WeightSender(group, bucket_bytes=BUCKET)
            for _ in range(3):
                sender.send(model.items())

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    with WeightTransferGroup("127.0.0.1", port, 1, 2, timeout_s=TIMEOUT_S) as group:
        receiver = WeightReceiver(group)
        staging = {n: torch.zeros_like(t) for n, t in model.items()}
        pools = []
        for _ in range(3):
            got = receiver.receive(expected_of(model), into=staging.__getitem__)
            assert all(torch.equal(got[n], t) for n, t in model.items())
            pools.append(sorted((b.data_ptr(), b.numel()) for b in receiver._buffers))
    thread.join(timeout=30)
    largest = max(b.nbytes for b in plan_buckets(PushHeader(
        [TensorMeta(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in model.items()], BUCKET)))
    assert pools[0] and all(n >= largest for _, n in pools[0])
    assert pools[1] == pools[0] == pools[2]


def test_shared_weights_reuse_their_segment_and_cast_in_the_copy():
    model = make_tensors()
    with SharedWeights() as shared:
        first = shared.share(model.items())
        doubled = {n: t * 2 for n, t in model.items()}
        again = shared.share(doubled.items())
        assert again["shm"] == first["shm"]  # same names, shapes and dtypes: the same segment, refilled
        got = read_shared(again, torch.device("cpu"))
        assert all(torch.equal(got[n], doubled[n]) for n in model)
        cast = shared.share(model.items(), dtype=torch.bfloat16)  # other dtypes: a new segment
        assert cast["shm"] != first["shm"]
        staging = {n: torch.empty(t.shape, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype)
                   for n, t in model.items()}
        got = read_shared(cast, torch.device("cpu"), stage=lambda n, t: staging[n].copy_(t))
        assert all(got[n] is staging[n] and torch.equal(got[n], model[n].to(staging[n].dtype)) for n in model)
    with pytest.raises(ValueError, match="closed it too early"):
        read_shared(cast, torch.device("cpu"))
    for bad in ("../../etc/passwd", "a/b", "..", ""):  # a name is a segment's, never a path
        with pytest.raises(ValueError, match="not a shared-memory segment name"):
            read_shared(dict(cast, shm=bad), torch.device("cpu"))


def test_malformed_cuda_handles_are_refused_before_anything_is_copied():
    """A CUDA IPC handle is a pickle: one that is not base64, names a global other than torch's
    tensor rebuild, or holds something other than a tensor is refused as a bad push (ValueError)."""
    import base64
    import pickle

    def handles(payload: str) -> dict:
        return {"kind": "cuda", "tensors": [{"name": "w", "handle": payload}]}

    def pickled(obj) -> str:
        return base64.b64encode(pickle.dumps(obj)).decode()

    for payload, why in (("not base64!", "bad CUDA IPC handle"), (pickled(print), "may not name builtins.print"),
                         (pickled([1, 2]), "must hold one tensor")):
        with pytest.raises(ValueError, match=why):
            read_shared(handles(payload), torch.device("cpu"))


def test_attaching_a_segment_starts_no_helper_process():
    """The engine reading a trainer's segment, and a trainer writing an engine's spare, map a
    segment another process made: that must not start multiprocessing's resource tracker (a
    helper process for the reader's life) nor register the segment for unlinking at exit."""
    code = """
import os, sys, torch
from weight_sync import read_shared
name = sys.argv[1]
got = read_shared({"kind": "shm", "shm": name, "tensors": [{"name": "w", "dtype": "float32", "shape": [4],
                                                         "offset": 0}]}, torch.device("cpu"))
assert got["w"].tolist() == [1.0, 2.0, 3.0, 4.0], got
from multiprocessing import resource_tracker
assert resource_tracker._resource_tracker._pid is None, "a resource tracker was started"
assert os.path.exists("/dev/shm/" + name)
"""
    shm = shared_memory.SharedMemory(create=True, size=64)
    try:
        torch.frombuffer(shm.buf, dtype=torch.float32, count=4).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        subprocess.run([sys.executable, "-c", code, shm.name], check=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
        assert os.path.exists(f"/dev/shm/{shm.name}")  # the reader's exit left it named
    finally:
        shm.close()
        shm.unlink()


def test_the_reader_keeps_the_last_segment_mapped_while_it_is_named():
    """The engine's side keeps the segment it read last mapped (refills are read through it), and
    drops it for another segment, once the trainer closed it, or on forget_shared()."""
    from weight_sync import ipc

    model = make_tensors()
    with SharedWeights() as shared:
        first = shared.share(model.items())
        read_shared(first, torch.device("cpu"))
        kept = ipc._kept
        assert kept is not None and kept.name == first["shm"]
        doubled = {n: t * 2 for n, t in model.items()}
        got = read_shared(shared.share(doubled.items()), torch.device("cpu"))
        assert ipc._kept is kept and all(torch.equal(got[n], doubled[n]) for n in model)
    with SharedWeights() as other:  # the first one is closed: a read of another segment drops it
        handles = other.share(model.items())
        read_shared(handles, torch.device("cpu"))
        assert ipc._kept is not kept and ipc._kept.name == handles["shm"]
    ipc.forget_shared()
    assert ipc._kept is None


def test_refusals_raise_on_both_sides_and_keep_the_group_in_step():
    model = make_tensors()
    q = "model.layers.1.self_attn.q_proj.weight"
    bad_pushes = {
        "unknown tensor name 'model.bogus.weight'": {**model, "model.bogus.weight": torch.zeros(3)},
        f"shape mismatch for '{q}': got (256, 128), expected (256, 256)": {**model, q: model[q][:, :128]},
        f"dtype mismatch for '{q}': got float32, expected bfloat16": {**model, q: model[q].float()},
    }
    with engine_workers([{}] * (len(bad_pushes) + 1)) as (group, results):
        sender = WeightSender(group, bucket_bytes=BUCKET)
        for problem, tensors in bad_pushes.items():
            t0 = time.perf_counter()
            with pytest.raises(WeightTransferError, match="receiver refused"):
                sender.send(tensors.items())
            (r,) = next_results(results)
            assert time.perf_counter() - t0 < 5
            assert not r["ok"] and problem in r["error"], r
        # the same group carries a correct push afterwards
        sender.send(model.items())
        (r,) = next_results(results)
        assert r["ok"] and r["equal"] and r["checksum"] == weights_checksum(model.items()), r


def test_subset_push_is_legal_and_gloo_buckets_stay_small():
    model = make_tensors()
    subset = {n: t for n, t in model.items() if "layers.2" in n or n == "lm_head.weight"}
    with engine_workers([{}, {}]) as (group, results):
        WeightSender(group, bucket_bytes=BUCKET).send(subset.items())
        (r,) = next_results(results)
        assert r["ok"] and r["equal"] and r["names"] == sorted(subset), r
        # a larger cap bounds only the staging memory: gloo buckets stay pipelined in 16 MiB
        sender = WeightSender(group, bucket_bytes=1 << 30)
        assert sender.bucket_bytes == GLOO_MAX_BUCKET_BYTES == 16 << 20
        stats = sender.send(model.items())
        (r,) = next_results(results)
        assert r["ok"] and r["equal"] and r["stats"]["num_buckets"] == stats["num_buckets"], r


def test_sender_side_error_reaches_the_receivers():
    def bad_iterable():
        yield "model.norm.weight", make_tensors()["model.norm.weight"]
        raise RuntimeError("trainer blew up while listing parameters")

    with engine_workers([{}, {}]) as (group, results):
        sender = WeightSender(group, bucket_bytes=BUCKET)
        with pytest.raises(WeightTransferError, match="trainer blew up"):
            sender.send(bad_iterable())
        (r,) = next_results(results)
        assert not r["ok"] and "sender aborted" in r["error"] and "trainer blew up" in r["error"]
        sender.send(make_tensors().items())
        assert next_results(results)[0]["ok"]


def test_three_processes_and_one_refusing_receiver():
    model = make_tensors()
    norm = "model.norm.weight"
    # push 1: everyone accepts; push 2: rank 2's model has no `norm`, so it refuses and rank 1
    # must raise too; push 3: a subset without `norm` goes through on both.
    pushes = [{}, {}, {}]
    with engine_workers(pushes, num_workers=2) as (group, results):
        sender = WeightSender(group, bucket_bytes=BUCKET)
        sender.send(model.items())
        r1, r2 = next_results(results, 2)
        assert r1["ok"] and r2["ok"] and r1["equal"] and r2["equal"]
        assert r1["checksum"] == r2["checksum"] == weights_checksum(model.items())

        with pytest.raises(WeightTransferError, match="receiver refused"):
            sender.send({**model, "model.extra_norm.weight": model[norm]}.items())
        r1, r2 = next_results(results, 2)
        assert not r1["ok"] and not r2["ok"]
        assert "unknown tensor name 'model.extra_norm.weight'" in r1["error"]

        subset = {n: t for n, t in model.items() if n != norm}
        sender.send(subset.items())
        r1, r2 = next_results(results, 2)
        assert r1["ok"] and r2["ok"] and r1["names"] == r2["names"] == sorted(subset)


# -- peers that die or hang mid-push -----------------------------------------------------------


def _dying_sender_main(port, ready, how):
    """A trainer that sends the header and the first bucket, then dies (or hangs)."""
    ready.set()
    group = WeightTransferGroup("127.0.0.1", port, 0, 2, timeout_s=5)
    send_first_bucket_only(WeightSender(group, bucket_bytes=BUCKET), make_tensors().items())
    if how == "exit":
        os._exit(1)
    time.sleep(60)


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_receiver_raises_when_the_sender_dies_or_hangs(how):
    port = find_free_port()
    ready = CTX.Event()
    proc = CTX.Process(target=_dying_sender_main, args=(port, ready, how), daemon=True)
    proc.start()
    try:
        assert ready.wait(60)
        group = WeightTransferGroup("127.0.0.1", port, 1, 2, timeout_s=5)
        receiver = WeightReceiver(group)
        got = None
        t0 = time.perf_counter()
        with pytest.raises(WeightTransferError, match="peer died or did not answer") as e:
            got = receiver.receive(expected_of(make_tensors()))
        elapsed = time.perf_counter() - t0
        assert got is None
        if how == "exit":
            assert elapsed < 3, elapsed  # a closed socket is noticed at once
        else:
            assert 4 < elapsed < 8, elapsed  # the group's timeout, not a hang
            assert "timed out" in str(e.value).lower()
        # the group is broken from now on: calls fail at once instead of hanging
        with pytest.raises(WeightTransferError, match="broken"):
            group.barrier()
        group.close()
    finally:
        proc.kill()
        proc.join()


def _slow_sender_main(port, results):
    """A trainer whose every bucket arrives well within the group's timeout (0.4 s apart, 30 s
    allowed) but whose whole push takes ~10 s; reports when its broadcasts failed."""
    group = WeightTransferGroup("127.0.0.1", port, 0, 2, timeout_s=TIMEOUT_S)
    try:
        send_some_buckets(WeightSender(group, bucket_bytes=BUCKET), make_tensors().items(), lambda n: n, pause_s=0.4)
        results.put(("sent", time.monotonic(), ""))
    except WeightTransferError as e:
        results.put(("failed", time.monotonic(), str(e)))


def test_a_deadline_bounds_the_whole_push_and_the_sender_fails_at_once():
    """No single bucket is late, the push as a whole is: the receiver's deadline (2 s) ends it,
    not the group's per-collective timeout (30 s), and breaking the group makes the sender fail
    at its next bucket instead of at that timeout."""
    port = find_free_port()
    results = CTX.Queue()
    proc = CTX.Process(target=_slow_sender_main, args=(port, results), daemon=True)
    proc.start()
    try:
        group = WeightTransferGroup("127.0.0.1", port, 1, 2, timeout_s=TIMEOUT_S)
        t0 = time.monotonic()
        with pytest.raises(WeightDeadlineError, match="deadline"), group.deadline(2.0):
            WeightReceiver(group).receive(expected_of(make_tensors()))
        gave_up = time.monotonic()
        assert 1.5 < gave_up - t0 < 6, gave_up - t0
        with pytest.raises(WeightTransferError, match="broken"):
            group.barrier()
        kind, when, error = results.get(timeout=60)
        assert kind == "failed", "the sender finished a push nobody received"
        assert when - gave_up < 3, f"the sender failed {when - gave_up:.1f} s after the receiver gave up: {error}"
        group.close()
    finally:
        proc.kill()
        proc.join()


def test_a_deadline_does_not_outlive_its_block():
    with engine_workers([{}, {}]) as (group, results):
        sender = WeightSender(group, bucket_bytes=BUCKET)
        with group.deadline(60):
            sender.send(make_tensors().items())
        assert group._deadline is None
        with pytest.raises(ValueError, match="positive"), group.deadline(0):
            pass
        sender.send(make_tensors().items())
        assert [r["ok"] for r in next_results(results, 2)] == [True, True]


def _dying_receiver_main(port):
    group = WeightTransferGroup("127.0.0.1", port, 1, 2, timeout_s=TIMEOUT_S)
    WeightReceiver(group)._recv_header()
    group.all_reduce_max(0)  # accepts, then dies before the buckets
    os._exit(1)


def test_sender_raises_when_a_receiver_dies():
    port = find_free_port()
    proc = CTX.Process(target=_dying_receiver_main, args=(port,), daemon=True)
    proc.start()
    try:
        group = WeightTransferGroup("127.0.0.1", port, 0, 2, timeout_s=TIMEOUT_S)
        t0 = time.perf_counter()
        with pytest.raises(WeightTransferError, match="peer died"):
            WeightSender(group, bucket_bytes=BUCKET).send(make_tensors().items())
        assert time.perf_counter() - t0 < 5
        group.close()
    finally:
        proc.kill()
        proc.join()


def test_rendezvous_times_out_without_peers():
    t0 = time.perf_counter()
    with pytest.raises(WeightTransferError, match="could not form"):
        WeightTransferGroup("127.0.0.1", find_free_port(), 0, 2, timeout_s=1)
    assert time.perf_counter() - t0 < 5


# -- pieces that need no process ---------------------------------------------------------------


def test_weight_sync_does_not_import_the_engine():
    code = "import sys, weight_sync; print(sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'rollout')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "[]"


def test_bucket_plan_covers_every_byte_once_within_the_cap():
    model = make_tensors()
    header = PushHeader(
        [TensorMeta(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in model.items()], BUCKET
    )
    buckets = plan_buckets(header)
    covered = {n: 0 for n in model}
    for b in buckets:
        assert 0 < b.nbytes <= BUCKET
        assert {header.tensors[i].dtype for i in b.indices} == {b.dtype}
        assert all(o % ALIGN == 0 for o in b.offsets)
        for i in b.indices:
            t = model[header.tensors[i].name]
            covered[header.tensors[i].name] += b.nbytes if b.piece_start >= 0 else t.numel() * t.element_size()
    assert covered == {n: t.numel() * t.element_size() for n, t in model.items()}
    # one bucket for everything when the cap allows it, per dtype
    header.bucket_bytes = 1 << 30
    assert [b.dtype for b in plan_buckets(header)] == ["float32", "bfloat16"]


def test_pack_copies_cast_on_one_thread_and_keep_the_callers_thread_count():
    """`_copy` (packing and unpacking) casts and copies strided slices with torch on one thread, so
    an fp32 -> bf16 push does not fight gloo's threads for the cores; the result is torch's cast."""
    threads = torch.get_num_threads()
    src = torch.randn(1000, 300, generator=torch.Generator().manual_seed(0)) * 1e3
    src[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38])
    cast = _copy(torch.empty(src.shape, dtype=torch.bfloat16), src)
    exact = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cast, src.bfloat16(), **exact)
    torch.testing.assert_close(_copy(torch.empty(1000, 100), src[:, ::3]), src[:, ::3], **exact)
    torch.testing.assert_close(_copy(torch.empty_like(src), src), src, **exact)
    assert torch.get_num_threads() == threads
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


def test_check_header_reports_every_problem():
    exp = {"a": ((2, 3), torch.float32), "b": ((4,), torch.bfloat16)}
    assert check_header(PushHeader([TensorMeta("b", "bfloat16", [4])], 64), exp) == ""
    bad = PushHeader([TensorMeta("a", "float16", [3, 2]), TensorMeta("c", "float32", [1])], 64)
    reason = check_header(bad, exp)
    assert "shape mismatch for 'a': got (3, 2), expected (2, 3)" in reason
    assert "dtype mismatch for 'a': got float16, expected float32" in reason
    assert "unknown tensor name 'c'" in reason


def test_checksum_is_deterministic_and_sees_every_bit():
    model = make_tensors()
    ref = weights_checksum(model.items())
    assert ref == weights_checksum(reversed(list(model.items())))  # order-free
    assert len(ref) == 64
    q = "model.layers.0.self_attn.q_proj.weight"
    flipped = model[q].clone()
    flipped.view(torch.int16)[0, 0] ^= 1  # lowest mantissa bit of one bf16 value
    assert weights_checksum({**model, q: flipped}.items()) != ref
    assert weights_checksum({**model, q: model[q].reshape(128, 512)}.items()) != ref  # shape counts
    assert weights_checksum({**model, "x": torch.zeros(1)}.items()) != ref
    assert weights_checksum(model.items(), dtype=torch.bfloat16) == weights_checksum(
        {n: t.bfloat16() if t.is_floating_point() else t for n, t in model.items()}.items()
    )
    with pytest.raises(ValueError, match="duplicate"):
        weights_checksum([("a", torch.zeros(1)), ("a", torch.zeros(1))])


def test_load_safetensors_folder(tmp_path):
    model = make_tensors()
    names = sorted(model)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, shard_names in shards.items():
        save_file({n: model[n].contiguous() for n in shard_names}, str(tmp_path / file))
    weight_map = {n: f for f, ns in shards.items() for n in ns}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "stray.safetensors").write_bytes(b"not listed in the index, so never read")
    loaded = dict(load_safetensors_folder(tmp_path))
    assert sorted(loaded) == names and all(torch.equal(loaded[n], model[n]) for n in names)
    assert weights_checksum(loaded.items()) == weights_checksum(model.items())

    single = tmp_path / "single"
    single.mkdir()
    save_file({"w": model["lm_head.weight"]}, str(single / "model.safetensors"))
    assert list(dict(load_safetensors_folder(single))) == ["w"]

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing: model-00002-of-00002"):
        list(load_safetensors_folder(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        list(load_safetensors_folder(tmp_path / "empty"))
