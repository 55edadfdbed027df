"""Helpers shared by the benchmarks (imported from the benchmark scripts' folder): the timing of
small calls, and the line that says which machine a table was measured on."""
import os
import time


def machine_line() -> str:
    """CPU model, cores and SIMD features: printed with every table (the machine changes)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"machine: {model}, {cores} cores, {' '.join(simd) or 'no AVX2'}"


def ms_per_call(fn, batch_s=0.01, total_s=0.3):
    """Best mean over many ~10 ms batches of calls: robust to other processes' bursts."""
    fn()
    n = 1
    while True:  # calibrate the batch size
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= batch_s:
            break
        n *= 2
    best, t_end = float("inf"), time.perf_counter() + total_s
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e3


def ms_per_cold_call(fn, n=30, flush_mb=256):
    """Median ms of `fn` right after reading `flush_mb` MB (evicting L1-L3, as a decode step's
    matmuls do before each attention or norm call)."""
    import torch

    flush = torch.ones(flush_mb << 18)  # float32: flush_mb MB
    fn()
    times = []
    for _ in range(n):
        flush.sum()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3
