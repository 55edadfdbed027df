"""The trainer's whole weight-update cycle against the real engine: pause -> push (gloo broadcast,
staging, atomic swap, version bump, prefix-cache reset) -> resume, for the default model in
float32 and bfloat16, with the engine core in its own process and this process as the trainer
(rank 0). Printed beside the bare transport time of the same push (WeightSender alone, the
engine's receive included), so the engine-side overhead (swap, repack) shows.

    python benchmarks/rl_cycle.py [--reps 3]
"""
import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from weight_sync import WeightSender, WeightTransferGroup, find_free_port, load_safetensors_folder  # noqa: E402


def run(dtype: str, reps: int) -> dict:
    llm = LLM(dtype=dtype, kv_cache_memory=256 << 20)
    tdtype = getattr(torch, dtype)
    state = [(n, t.to(tdtype)) for n, t in load_safetensors_folder(llm.config.model)]
    port = find_free_port()
    joined = threading.Thread(target=llm.init_weight_transfer, args=("127.0.0.1", port, 2))
    joined.start()
    group = WeightTransferGroup("127.0.0.1", port, 0, 2)
    joined.join()
    sender = WeightSender(group)
    params = SamplingParams(temperature=0, max_tokens=8)
    best = {}
    for _ in range(reps):
        llm.generate("Warm the prefix cache", params, use_tqdm=False)
        t0 = time.perf_counter()
        llm.pause_generation(mode="keep", clear_cache=False)
        t1 = time.perf_counter()
        result = {}
        receiver = threading.Thread(target=lambda: result.update(llm.update_weights()))
        receiver.start()
        stats = sender.send(state)
        receiver.join()
        t2 = time.perf_counter()
        llm.resume_generation()
        t3 = time.perf_counter()
        row = {"pause_s": t1 - t0, "push_s": t2 - t1, "send_s": stats["seconds"], "resume_s": t3 - t2,
               "cycle_s": t3 - t0, "gb": stats["num_bytes"] / 1e9}
        if not best or row["cycle_s"] < best["cycle_s"]:
            best = row
    best["version"] = llm.weight_version
    group.close()
    llm.shutdown()
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    rows = [(d, run(d, args.reps)) for d in args.dtypes.split(",")]
    print(f"{'dtype':9s} {'GB':>5s} {'pause s':>8s} {'push s':>7s} {'(sender)':>9s} {'resume s':>9s} {'cycle s':>8s} "
          f"{'GB/s':>6s}")
    for d, r in rows:
        print(f"{d:9s} {r['gb']:5.2f} {r['pause_s']:8.3f} {r['push_s']:7.3f} {r['send_s']:9.3f} {r['resume_s']:9.3f} "
              f"{r['cycle_s']:8.3f} {r['gb'] / r['cycle_s']:6.2f}")
    print("best of --reps cycles; push = engine's update_weights call (receive, swap, version, cache reset);"
          " (sender) = WeightSender.send alone")


if __name__ == "__main__":
    main()
