"""Weight push trainer -> engine: seconds and GB/s for a SmolLM2-135M-shaped set of tensors.

Two processes on this machine, a gloo group over TCP on 127.0.0.1: the trainer (this process,
rank 0) pushes random tensors shaped like SmolLM2-135M (30 layers + tied embedding, ~134.5M
params) with `WeightSender.send`, in float32 and bfloat16 (and float32 tensors cast to bfloat16
in flight, `send(dtype=)`: "float32>bfloat16"), sweeping the bucket cap (over gloo a cap above
16 MiB bounds only the staging memory: "broadcasts" shows the buckets sent); the engine (a spawned
process, rank 1) receives with `WeightReceiver.receive` into staging tensors kept from push to
push, as the engine does (engine/worker/weight_buffers.py). Each row is the best of --reps
pushes, timed on the sender from the header to the final confirmation (so the receiver holds
everything). GB/s counts payload bytes once.

References measured in the same run: (1) this machine's copy bandwidth, one large
`Tensor.copy_` of 512 MiB counting bytes read + written, re-measured next to every row because
the load on a shared 2-core box drifts (a loopback push moves each byte through several copies:
staging, socket buffers, fresh receive buffer, so it sits far below this); (2) the transport
alone, "raw": the push's own byte count broadcast through the same group in reused 16 MiB
buffers, two in flight, no packing, no protocol. It runs right before every push of a row (the
two alternate, so drift hits both alike), and "of raw" is the row's best push over its best raw.
Then the time of `weights_checksum` on the same tensors.

NCCL rows need two GPUs (one rank per GPU); they are skipped otherwise.

On a 2-core box the loopback transport is bound by the CPU (both ends of the socket copy every
byte, on the cores the packing needs too). To see the push where a link is the bound, as between
a trainer and an engine on two machines, shape the loopback first (root; push and raw alike):
`tc qdisc add dev lo root tbf rate 16gbit burst 8mb latency 100ms`, and afterwards
`tc qdisc del dev lo root`.

    python benchmarks/weight_transfer.py                  # ~1 minute on 2 cores
    python benchmarks/weight_transfer.py --buckets 64 one --reps 5
"""
import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp

# Run as a script, this file's folder comes first on sys.path, and this very file would then
# shadow the `weight_sync` package it benchmarks: put the repository root ahead of it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import machine_line  # noqa: E402  (benchmarks/timing.py)
from weight_sync import (  # noqa: E402
    WeightReceiver,
    WeightSender,
    WeightTransferGroup,
    find_free_port,
    weights_checksum,
)

MiB = 1 << 20
RAW_CHUNK = 16 * MiB  # the transport reference's broadcasts: the gloo bucket cap, two in flight


def smollm2_135m_shapes() -> dict[str, tuple[int, ...]]:
    hidden, kv, inter, vocab, layers = 576, 192, 1536, 49152, 30
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (hidden, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def raw_transport(group, nbytes: int, buffers: list) -> float:
    """Seconds to broadcast `nbytes` through `group` in RAW_CHUNK pieces from two reused buffers
    (the same on both ranks: the sender's timing ends at a barrier)."""
    t0 = time.perf_counter()
    in_flight = []
    for k, a in enumerate(range(0, nbytes, RAW_CHUNK)):
        if len(in_flight) == len(buffers):
            in_flight.pop(0).wait()
        in_flight.append(group.broadcast_async(buffers[k % len(buffers)][: min(RAW_CHUNK, nbytes - a)]))
    for p in in_flight:
        p.wait()
    group.barrier()
    return time.perf_counter() - t0


def push_bytes(shapes, dtype: torch.dtype) -> int:
    return sum(torch.Size(s).numel() for s in shapes.values()) * dtype.itemsize


def _engine_main(port, backend, device, dtypes, num_pushes_each):
    """Rank 1: per dtype, `num_pushes_each` (raw transport, push) pairs, in the order the trainer
    sends them."""
    group = WeightTransferGroup("127.0.0.1", port, 1, 2, backend=backend, timeout_s=120, device=device)
    raw_buffers = [torch.empty(RAW_CHUNK, dtype=torch.uint8, device=group.device) for _ in range(2)]
    receiver = WeightReceiver(group)
    shapes = smollm2_135m_shapes()
    for dtype in dtypes:
        wire = getattr(torch, dtype.split(">")[-1])
        expected = {n: (s, wire) for n, s in shapes.items()}
        staging = {n: torch.zeros(s, dtype=wire, device=group.device) for n, s in shapes.items()}
        for _ in range(num_pushes_each):
            raw_transport(group, push_bytes(shapes, wire), raw_buffers)
            receiver.receive(expected, into=staging.__getitem__)
        del staging
    group.close()


def copy_bandwidth(device=None, nbytes=512 * MiB, reps=3) -> float:
    """GB/s of one large `Tensor.copy_`, counting bytes read + written."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    best = min(_timed(lambda: (dst.copy_(src), sync())) for _ in range(reps))
    return 2 * nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bucket_bytes_of(label: str) -> int:
    return 1 << 40 if label == "one" else int(label) * MiB  # "one": a single bucket per dtype


def run(backend: str, dtypes, bucket_labels, reps, rows):
    device = "cuda:0" if backend == "nccl" else None
    shapes = smollm2_135m_shapes()
    port = find_free_port()
    ctx = mp.get_context("spawn")
    engine = ctx.Process(
        target=_engine_main,
        args=(port, backend, "cuda:1" if backend == "nccl" else None, dtypes, len(bucket_labels) * reps),
        daemon=True,
    )
    engine.start()
    group = WeightTransferGroup("127.0.0.1", port, 0, 2, backend=backend, timeout_s=120, device=device)
    g = torch.Generator().manual_seed(0)
    raw_buffers = [torch.ones(RAW_CHUNK, dtype=torch.uint8, device=group.device) for _ in range(2)]
    try:
        for dtype in dtypes:
            dt, wire = getattr(torch, dtype.split(">")[0]), getattr(torch, dtype.split(">")[-1])
            tensors = {n: torch.randn(s, generator=g).to(device or "cpu", dt) for n, s in shapes.items()}
            nbytes = push_bytes(shapes, wire)
            for label in bucket_labels:
                sender = WeightSender(group, bucket_bytes=bucket_bytes_of(label))
                raws, stats = [], []
                for _ in range(reps):  # alternating, so that the box's drift hits both alike
                    raws.append(raw_transport(group, nbytes, raw_buffers))
                    stats.append(sender.send(tensors.items(), dtype=wire))
                best = min(stats, key=lambda s: s["seconds"])
                copy_gbps = copy_bandwidth(group.device)  # measured next to each row: the load on this box drifts
                rows.append((backend, dtype, label, best["num_buckets"], best["seconds"], best["gb_per_s"],
                             nbytes / min(raws) / 1e9, copy_gbps))
                print(f"  {backend} {dtype:8s} bucket {label:>4s}: {best['seconds']:.3f} s (raw {min(raws):.3f} s)",
                      flush=True)
            del tensors
    finally:
        group.close()
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()


def checksum_rows(dtypes, reps):
    shapes = smollm2_135m_shapes()
    g = torch.Generator().manual_seed(0)
    fp32 = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    rows = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        tensors = {n: t.to(dt) for n, t in fp32.items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        best = min(_timed(lambda: weights_checksum(tensors.items())) for _ in range(reps))
        rows.append((f"{dtype} tensors", nbytes, best))
        if dt != torch.float32:  # the trainer's side: fp32 master weights hashed as the engine's dtype
            best = min(_timed(lambda: weights_checksum(fp32.items(), dtype=dt)) for _ in range(reps))
            rows.append((f"float32 cast to {dtype}", nbytes, best))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float32>bfloat16"],
                    help="a>b: tensors in a, sent as b")
    ap.add_argument("--buckets", nargs="+", default=["4", "16", "64", "256", "one"], help="MiB, or 'one'")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    t_start = time.perf_counter()
    n_params = sum(torch.Size(s).numel() for s in smollm2_135m_shapes().values())
    print(f"SmolLM2-135M-shaped push: {n_params / 1e6:.1f}M params, {len(smollm2_135m_shapes())} tensors; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n{machine_line()}")

    rows = []
    run("gloo", args.dtypes, args.buckets, args.reps, rows)
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        run("nccl", args.dtypes, args.buckets, args.reps, rows)
    else:
        print("nccl: skipped (needs two CUDA devices, one per rank)")

    print()
    print("| backend | dtype            | bucket MiB | broadcasts | seconds | GB/s | raw GB/s | of raw | copy GB/s | of copy |")
    print("|---------|------------------|-----------:|-----------:|--------:|-----:|---------:|-------:|----------:|--------:|")
    for backend, dtype, label, nb, sec, gbps, raw_gbps, copy_gbps in rows:
        print(f"| {backend:7s} | {dtype:16s} | {label:>10s} | {nb:>10d} | {sec:7.3f} | {gbps:4.2f} | {raw_gbps:8.2f} "
              f"| {gbps / raw_gbps:>6.0%} | {copy_gbps:9.1f} | {gbps / copy_gbps:>7.1%} |")

    print()
    print("| weights_checksum          | MB   | seconds | GB/s |")
    print("|---------------------------|-----:|--------:|-----:|")
    for what, nbytes, sec in checksum_rows([d for d in args.dtypes if ">" not in d], args.reps):
        print(f"| {what:25s} | {nbytes / 1e6:4.0f} | {sec:7.3f} | {nbytes / sec / 1e9:4.2f} |")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
