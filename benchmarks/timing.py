"""Timing helper shared by the kernel benchmarks (imported from the benchmark scripts' folder)."""
import time


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
