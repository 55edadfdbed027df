"""The routed experts of one MoE layer on CPU (kernels.moe.fused_experts), ms per call, through
  ours          the C++ op (kernels/csrc/moe.cpp; what the dispatcher runs on CPU),
  torch loop    kernels.moe.fused_experts_torch (the per-expert torch reference),
  transformers  transformers' Qwen3MoeExperts.forward (eager), on the same weight tensors,
at T tokens per call with random routing (softmax top-k of random logits): the median of single
calls' times (>= 5 calls, >= 0.5 s per cell). "experts" is the number of experts the call
touches, "MB" their weight bytes (each streamed once by ours), and "GB/s" that over ours' time;
the memcpy line above the table is torch's copy_ of a 256 MB buffer (bytes read + written per
second) in the same run, for scale.

Shapes: "qwen3-30b-a3b" is one layer of Qwen3-30B-A3B (hidden 2048, 128 experts of intermediate
768, top 8: 2.4 GB of float32 weights, so every call streams from memory); "small" is hidden 512,
32 experts of 256, top 4 (50 MB float32: partly cache-resident, so its GB/s can exceed memory's).
Run from the repo root:  .venv/bin/python benchmarks/moe.py [--quick] [--threads N] [--T 1 8 32 128]
The machine's other load moves every number: compare the columns of one run.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kernels import cpu_ext
from kernels.moe import fused_experts_torch, route
from timing import machine_line  # noqa: E402  (benchmarks/timing.py)

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "small": (512, 256, 32, 4)}  # H, I, E, k


def median_ms(fn, total_s: float, min_calls: int = 5) -> float:
    """The median of single calls' times: on a shared machine a call now and then waits a time
    slice for a descheduled thread (an OpenMP barrier), which a mean over a batch would absorb."""
    fn()
    times, t_end = [], time.perf_counter() + total_s
    while len(times) < min_calls or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def memcpy_gb_s(mb: int = 256) -> float:
    src = torch.ones(mb << 18)  # float32
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def transformers_experts(w13: torch.Tensor, w2: torch.Tensor):
    """Qwen3MoeExperts (eager loop over experts) holding w13 / w2 themselves (no copy)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, two_i, H = w13.shape
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=two_i // 2, num_experts=E)
    cfg._experts_implementation = "eager"
    experts = Qwen3MoeExperts(cfg)  # its own (E, 2I, H) tensors are torch.empty: never touched
    experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return experts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 1 and 32 only, shorter timings")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--T", type=int, nargs="+", default=None, help="tokens per call (default 1 8 32 128)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    token_counts = args.T or ([1, 32] if args.quick else [1, 8, 32, 128])
    total_s = 0.2 if args.quick else 0.5
    ext = cpu_ext.load()
    if ext is None:
        sys.exit("the C++ extension did not build (see the 'kernels' warning): nothing to compare")
    print(machine_line(), f"| torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"memcpy: {memcpy_gb_s():.1f} GB/s (read + write)")
    print("| shape | dtype | T | experts | MB | ours ms | torch loop ms | transformers ms | vs loop | "
          "vs transformers | ours GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        H, I, E, k = SHAPES[shape]
        for dtype in (torch.float32, torch.bfloat16):
            print(f"(generating {shape} {str(dtype)[6:]} weights ...)", file=sys.stderr, flush=True)
            w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.02).to(dtype)
            w2 = (torch.randn(E, H, I, generator=gen) * 0.02).to(dtype)
            hf = transformers_experts(w13, w2)
            for T in token_counts:
                x = torch.randn(T, H, generator=gen).to(dtype)
                ids, weights = route(torch.randn(T, E, generator=gen), k, True)
                ids64, weights_x = ids.long(), weights.to(dtype)
                with torch.inference_mode():
                    t_ours = median_ms(lambda: ext.fused_experts(x, w13, w2, ids, weights), total_s)
                    t_loop = median_ms(lambda: fused_experts_torch(x, w13, w2, ids, weights), total_s)
                    t_hf = median_ms(lambda: hf(x, ids64, weights_x), total_s)
                touched = ids.unique().numel()
                mb = touched * 3 * I * H * w13.element_size() / 1e6
                print(f"| {shape} | {str(dtype)[6:]} | {T} | {touched} | {mb:.0f} | {t_ours:.2f} | {t_loop:.2f} | "
                      f"{t_hf:.2f} | {t_loop / t_ours:.1f}x | {t_hf / t_ours:.1f}x | {mb / t_ours:.1f} |", flush=True)
            del w13, w2, hf
    print(f"(load average at the end {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
