"""The trainer's whole weight-update cycle against the real engine: pause -> push (gloo broadcast,
staging, atomic swap, version bump, prefix-cache reset) -> resume, for the default model in
float32 and bfloat16, with the engine core in its own process and this process as the trainer
(rank 0). Printed beside the bare transport time of the same push (WeightSender alone, the
engine's receive included), so the engine-side overhead (swap, repack) shows. Route "shm" is the
same cycle for a trainer on the same machine: SharedWeights (shared memory, one segment reused
from push to push) + update_weights_from_ipc, no process group. Route "spare" is what the client's
push_weights_shared does on a CPU server: lease the engine's staging memory, write the tensors
into it (SpareWriter; before the pause: generation goes on meanwhile), then the update swaps
them in; its push time counts the lease and the write too. The writer packs the projections for
the engine's matmul kernels as it writes them (the lease names the packs it runs), so the update
repacks nothing; "spare, plain" is the same route with plain tensors only, repacked by the engine.
"spare, fp32 masters" (a bf16 engine): the trainer's weights are float32, as a mixed-precision
trainer keeps them, and the write casts them on the way (GB counts the engine's bf16 bytes).

"of copy": the push's GB/s (trainer tensors -> live weights, payload bytes once) over this
machine's copy bandwidth (one large Tensor.copy_ of the same bytes, counting bytes read +
written), measured in the same run: one copy of the weights at full speed would be 50%.

--device cuda: the engine on the GPU and this process as a trainer holding the same weights on
that GPU (the engine core is a process of its own); route "cuda ipc" is the engine-level path of
the client's push_weights_shared to a CUDA server: SharedWeights.share (CUDA IPC handles) +
update_weights_from_ipc (the engine reads the trainer's memory in place, on the device). Its copy
reference is a device-to-device Tensor.copy_ of the very tensors pushed into tensors of the same
shapes, synchronized (same read + written convention; its seconds are printed below the table).
After the timed cycles a check (printed; exit status 1 if it fails): a push of changed weights
(every tensor's rows reversed) leaves the engine's checksum equal to the trainer's and changes
its greedy tokens, and pushing the loaded weights back brings the first tokens back.

    python benchmarks/rl_cycle.py [--reps 3] [--model FOLDER]
    python benchmarks/rl_cycle.py --device cuda --model FOLDER
"""
import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from timing import machine_line  # noqa: E402  (benchmarks/timing.py)
from weight_sync import (SharedWeights, SpareWriter, WeightSender, WeightTransferGroup,  # noqa: E402
                         find_free_port, load_safetensors_folder, weights_checksum)


def run(dtype: str, reps: int, model: str | None = None) -> dict:
    """{route: best cycle} for the gloo broadcast and the same-machine shared-memory route."""
    llm = LLM(model, dtype=dtype, kv_cache_memory=256 << 20)
    tdtype = getattr(torch, dtype)
    state = [(n, t.to(tdtype)) for n, t in load_safetensors_folder(llm.config.model)]
    port = find_free_port()
    joined = threading.Thread(target=llm.init_weight_transfer, args=("127.0.0.1", port, 2))
    joined.start()
    group = WeightTransferGroup("127.0.0.1", port, 0, 2)
    joined.join()
    sender = WeightSender(group)

    def gloo_push() -> float:  # the engine receives while this process sends
        receiver = threading.Thread(target=llm.update_weights)
        receiver.start()
        stats = sender.send(state)
        receiver.join()
        return stats["seconds"]

    writer = SpareWriter()

    def spare_write_of(tensors, layouts=writer.layouts):
        def write() -> dict:  # before the pause: lease the engine's spare and fill it
            handles = writer.write(llm.lease_weight_spare("bench", layouts), tensors)
            return lambda: llm.update_weights_from_ipc(handles)
        return write

    # a partial push (3 of the 30 layers: ~8% of the bytes) costs in proportion to what it moves
    some = [(n, t) for n, t in state if any(f".layers.{i}." in n for i in (0, 1, 2))]
    shared, some_shared = SharedWeights(), SharedWeights()
    best = {"gloo": cycle(llm, gloo_push, reps), "shm": cycle(llm, shared_push(llm, state, shared), reps),
            "shm, 3 layers": cycle(llm, shared_push(llm, some, some_shared), reps),
            "spare": cycle(llm, None, reps, spare_write_of(state)),
            "spare, plain": cycle(llm, None, reps, spare_write_of(state, [])),
            "spare, 3 layers": cycle(llm, None, reps, spare_write_of(some))}
    if tdtype == torch.bfloat16:
        masters = [(n, t.float()) for n, t in state]
        best["spare, fp32 masters"] = cycle(llm, None, reps, spare_write_of(masters))
        del masters
    copy_gbps = copy_bandwidth(sum(t.numel() * t.element_size() for _, t in state))
    for route, row in best.items():
        pushed = some if route.endswith("3 layers") else state
        row["gb"], row["copy_gbps"] = sum(t.numel() * t.element_size() for _, t in pushed) / 1e9, copy_gbps
    shared.close()
    some_shared.close()
    writer.close()
    group.close()
    llm.shutdown()
    return best


def run_cuda(dtype: str, reps: int, model: str | None = None) -> dict:
    """{route: best cycle} for CUDA IPC from this process's copy of the weights on the engine's GPU
    (the engine core is another process), the whole model and 3 of its layers; "verified": the
    check after them (see the module's docstring)."""
    llm = LLM(model, dtype=dtype, device="cuda", kv_cache_memory=256 << 20)
    tdtype = getattr(torch, dtype)
    state = [(n, t.to("cuda", tdtype)) for n, t in load_safetensors_folder(llm.config.model)]
    some = [(n, t) for n, t in state if any(f".layers.{i}." in n for i in (0, 1, 2))]

    shared, some_shared = SharedWeights(), SharedWeights()
    best = {"cuda ipc": cycle(llm, shared_push(llm, state, shared), reps),
            "cuda ipc, 3 layers": cycle(llm, shared_push(llm, some, some_shared), reps)}
    for route, row in best.items():
        pushed = some if route.endswith("3 layers") else state
        row["gb"] = sum(t.numel() * t.element_size() for _, t in pushed) / 1e9
        row["copy_s"] = device_copy_seconds([t for _, t in pushed])
        row["copy_gbps"] = 2 * row["gb"] / row["copy_s"]
    some_shared.close()

    def greedy() -> list[int]:
        out = llm.generate("The weights", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    first = greedy()
    changed = [(n, t.flip(0)) for n, t in state]  # (a tied lm_head stays equal to the embedding: the engine drops it)
    llm.update_weights_from_ipc(shared.share(changed))
    embed = dict(changed).get("model.embed_tokens.weight")
    kept = [(n, t) for n, t in changed if n != "lm_head.weight" or embed is None or not torch.equal(t, embed)]
    checks = {"checksum equal to the trainer's": llm.weights_checksum() == weights_checksum(kept, tdtype),
              "greedy tokens changed": greedy() != first}
    llm.update_weights_from_ipc(shared.share(state))
    checks["the loaded weights pushed back give the first tokens back"] = greedy() == first
    shared.close()
    print(f"  {dtype}, a push of changed weights by CUDA IPC: "
          + "; ".join(f"{what}: {'yes' if ok else 'NO'}" for what, ok in checks.items()), flush=True)
    best["cuda ipc"]["verified"] = all(checks.values())
    del state, some, changed, kept
    llm.shutdown()
    return best


def shared_push(llm, tensors, shared: SharedWeights):
    """A push through `shared`: share (CPU tensors: one copy into shared memory; CUDA ones: IPC
    handles, no copy), then the engine copies them in. The push returns the share's seconds."""
    def push() -> float:
        t = time.perf_counter()
        handles = shared.share(tensors)
        share_s = time.perf_counter() - t
        llm.update_weights_from_ipc(handles)
        return share_s
    return push


def device_copy_seconds(tensors, reps: int = 10) -> float:
    """Best of `reps`: each CUDA tensor Tensor.copy_'d into one of the same shape on its device,
    synchronized (the bytes a push moves, as a device-to-device copy)."""
    dst = [torch.empty_like(t) for t in tensors]
    best = float("inf")
    for _ in range(reps + 1):  # (the first one warms up)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
    """GB/s of one Tensor.copy_ of `nbytes` between touched buffers, counting bytes read + written
    (the best of `reps`: with 3 it swung 26-50 GB/s between two calls of one run on a shared host)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):  # (the first one touches dst)
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def cycle(llm, push, reps: int, write_first=None) -> dict:
    """Best of `reps`: pause -> push() (returns the trainer's part of it) -> resume. With
    `write_first`: it runs before the pause (the trainer's part) and returns the push."""
    params = SamplingParams(temperature=0, max_tokens=8)
    best = {}
    for _ in range(reps):
        llm.generate("Warm the prefix cache", params, use_tqdm=False)
        written = 0.0
        if write_first is not None:
            t = time.perf_counter()
            update = write_first()
            written = time.perf_counter() - t
            push = lambda: (update(), written)[1]  # noqa: E731
        t0 = time.perf_counter()
        llm.pause_generation(mode="keep", clear_cache=False)
        t1 = time.perf_counter()
        send_s = push()
        t2 = time.perf_counter()
        llm.resume_generation()
        t3 = time.perf_counter()
        row = {"pause_s": t1 - t0, "push_s": t2 - t1 + written, "send_s": send_s, "resume_s": t3 - t2,
               "cycle_s": t3 - t0}
        if not best or row["push_s"] < best["push_s"]:
            best = row
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: the default model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the engine and the trainer's weights on one GPU, pushed by CUDA IPC")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("rl_cycle.py --device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    print(f"{machine_line()}; torch {torch.__version__}"
          + (f"; {torch.cuda.get_device_name(0)}" if args.device == "cuda" else ""))
    run_dtype = run_cuda if args.device == "cuda" else run
    rows = [(d, route, r) for d in args.dtypes.split(",") for route, r in run_dtype(d, args.reps, args.model).items()]
    print("| dtype | route | GB | pause s | push s | (sender) | resume s | cycle s | push GB/s | copy GB/s | of copy |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for d, route, r in rows:
        gbps = r["gb"] / r["push_s"]
        print(f"| {d} | {route} | {r['gb']:.2f} | {r['pause_s']:.3f} | {r['push_s']:.3f} | {r['send_s']:.3f} | "
              f"{r['resume_s']:.3f} | {r['cycle_s']:.3f} | {gbps:.2f} | {r['copy_gbps']:.1f} | "
              f"{gbps / r['copy_gbps']:.0%} |")
    print("best of --reps cycles; push = the engine's update call (receive, checks, swap, version, cache reset),"
          " for spare also the lease and the write made before the pause; (sender) = the trainer's part alone:"
          " WeightSender.send (gloo), SharedWeights.share (shm, cuda ipc), lease + SpareWriter.write (spare)")
    if args.device == "cuda":
        print("copy GB/s (cuda): the pushed tensors copy_'d on the GPU into tensors of the same shapes, synchronized,"
              " counting bytes read + written; below, the push beside that copy, the pushed bytes counted once:")
        for d, route, r in rows:
            print(f"  {d} {route}: push {r['push_s'] * 1e3:.2f} ms = {r['gb'] / r['push_s']:.1f} GB/s; d2d copy"
                  f" {r['copy_s'] * 1e3:.2f} ms = {r['gb'] / r['copy_s']:.1f} GB/s"
                  + (" (the push beat the copy: did the update return before its copies ran?)"
                     if r["push_s"] < r["copy_s"] else ""))
        if not all(r.get("verified", True) for _, _, r in rows):
            sys.exit("the check after the CUDA IPC pushes failed (the lines above with NO)")


if __name__ == "__main__":
    main()
