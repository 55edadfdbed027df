"""Soak: many sleep / wake cycles and many full weight pushes through a real server, with the
memory of server + engine core sampled as they go. Holds when the RSS ends within 5% of where it
stood after the first cycles (warm-up), greedy outputs stay identical, and the weights checksum
after the pushes (of the original weights) is the original one.

    .venv/bin/python benchmarks/soak.py                       # 1,000 sleep/wake + 500 pushes
    .venv/bin/python benchmarks/soak.py --sleep-cycles 100 --push-cycles 50
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.client import RolloutClient  # noqa: E402
from rollout.subprocess_server import start  # noqa: E402

PROMPT, GREEDY = [1, 2, 3, 4, 5], {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
WARMUP = 5  # cycles before the baseline RSS (allocator pools settle)


def rss_mb(pid: int) -> float:
    """RSS of a process and its children (the engine core)."""
    total = 0
    pids = [pid] + [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{p}/status").read_text())
        total += int(m.group(1)) if m else 0
    return total / 1024


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def soak(client: RolloutClient, pid: int, kind: str, cycles: int, every: int) -> dict:
    """`cycles` sleep/wake cycles or full pushes; RSS sampled every `every` cycles."""
    reference = client.generate(PROMPT, GREEDY)[0].token_ids
    checksum = client.weights_checksum()
    if kind == "push":
        from safetensors.torch import load_file

        weights = load_file(str(Path(client.model_info()[0]["root"]) / "model.safetensors"))
        client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=60)
    samples, baseline, t0 = [], None, time.perf_counter()
    try:
        for i in range(1, cycles + 1):
            if kind == "sleep":
                client.sleep(level=1)
                client.wake_up()
            else:
                client.push_weights(weights.items(), version=client.weight_version() + 1)
            if i == min(WARMUP, cycles):
                baseline, t0 = rss_mb(pid), time.perf_counter()
            if i % every == 0 or i == cycles:
                samples.append((i, rss_mb(pid)))
                assert client.generate(PROMPT, GREEDY)[0].token_ids == reference, f"outputs changed at cycle {i}"
                print(f"[soak] {kind} {i}/{cycles}: RSS {samples[-1][1]:.0f} MB", file=sys.stderr, flush=True)
    finally:
        if kind == "push":
            client.close_weight_transfer()
    seconds = time.perf_counter() - t0
    final = samples[-1][1]
    return {"kind": kind, "cycles": cycles, "s_per_cycle": seconds / max(cycles - WARMUP, 1),
            "rss_baseline_mb": baseline, "rss_final_mb": final, "rss_max_mb": max(r for _, r in samples),
            "drift": (final - baseline) / baseline, "checksum_same": client.weights_checksum() == checksum}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sleep-cycles", type=int, default=1000)
    ap.add_argument("--push-cycles", type=int, default=500)
    ap.add_argument("--every", type=int, default=50, help="sample RSS and check outputs this often")
    args = ap.parse_args(argv)
    log = tempfile.NamedTemporaryFile("w", prefix="soak-serve-", suffix=".log", delete=False)
    log.close()
    print(f"[soak] CPU: {cpu_model()} ({os.cpu_count()} cores); server log {log.name}", file=sys.stderr)
    server = start("--dtype", "float32", "--max-model-len", "512", log_path=log.name, cwd=ROOT)
    try:
        with RolloutClient(server.url, timeout=600) as client:
            rows = [soak(client, server.proc.pid, kind, n, args.every)
                    for kind, n in (("sleep", args.sleep_cycles), ("push", args.push_cycles)) if n]
    finally:
        server.stop()
    print(f"\nCPU: {cpu_model()}")
    print(f"{'cycle':8}{'count':>7}{'s/cycle':>9}{'RSS base MB':>13}{'RSS end MB':>12}{'RSS max MB':>12}"
          f"{'drift':>8}{'checksum':>10}")
    for r in rows:
        print(f"{r['kind']:8}{r['cycles']:7d}{r['s_per_cycle']:9.3f}{r['rss_baseline_mb']:13.0f}"
              f"{r['rss_final_mb']:12.0f}{r['rss_max_mb']:12.0f}{r['drift']:8.1%}"
              f"{'same' if r['checksum_same'] else 'CHANGED':>10}")
    return rows


if __name__ == "__main__":
    main()
