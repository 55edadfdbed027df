"""The decode step's matmuls on CPU: one model-sized step of SmolLM2-135M's 121 projections (30
layers x qkv, o, gate_up, down, and the LM head; random weights) at a given number of rows, ms
per step, through

bfloat16 (default):
  F.linear     torch's bf16 matmul (throughput.py's "floor"),
  oneDNN       torch.ops.mkldnn on weights prepacked once (the engine's bf16 path on CPUs with
               none of the kernels below),
  dot          bf16_vnni_linear on weights packed by bf16_vnni_pack (the engine's bf16 path on
               CPUs with AVX-512 BF16 and no AMX),
  AMX          bf16_amx_linear on the same packed weights (the engine's path with AMX: Xeons from
               Sapphire Rapids on),
  panels       bf16_panel_linear on weights packed by bf16_panel_pack (float32 arithmetic on bf16
               weights: the engine's bf16 path on CPUs with AVX-512 or AVX2 + FMA but no AVX-512 BF16);
float32 (--dtype float32):
  F.linear, oneDNN as above (oneDNN: the engine's path on CPUs with neither AVX-512 nor AVX2),
  rows         invariant_linear on the plain weight (batch-invariant mode there: the panels'
               summation order without a packed copy),
  panels       f32_panel_linear on weights packed by f32_panel_pack (the engine's float32 path,
               batch-invariant mode included, on CPUs with AVX-512 or AVX2 + FMA).
Each run also times packing the 121 weights (best of --reps): oneDNN's reorder (fresh memory each
time) against ours rewriting the memory it packed before, as a weight update does, one call a
weight and all in one call (write_many, a trainer's write into a leased spare; in bf16 also from
float32 masters, cast on the way, packed and plain beside torch's cast), beside a Tensor.copy_ of
the same bytes into touched memory (a pack reads and writes every byte once, as a copy does).

Run from the repo root:  .venv/bin/python benchmarks/kernels_matmul.py [--dtype float32] [--rows 1 4 16 32 128]
The weights (~270 MB per bf16 copy) do not fit in cache: each step streams them from memory, as a
decode step does. Compare the columns of one run; the host's speed moves between runs.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from kernels import cpu_ext
from timing import machine_line  # noqa: E402  (benchmarks/timing.py)

H, INTER, V, LAYERS = 576, 1536, 49152, 30
SHAPES = [(3 * 576, H), (H, H), (2 * INTER, H), (H, INTER)] * LAYERS + [(V, H)]  # (N, K) of each projection


def ms_per_step(fns, reps: int) -> list[float]:
    """The best time of each of `fns` over `reps` rounds, the fns interleaved within a round (the
    host's speed drifts: side by side, the columns see the same drift)."""
    best = [float("inf")] * len(fns)
    for r in range(reps + 1):  # (round 0 warms up)
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            if r:
                best[i] = min(best[i], time.perf_counter() - t)
    return [b * 1e3 for b in best]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(machine_line(), f"torch threads {torch.get_num_threads()}, {args.dtype}")
    ext = cpu_ext.load()
    g = torch.Generator().manual_seed(0)
    print("packing 121 weights ...", file=sys.stderr, flush=True)
    weights = [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for n, k in SHAPES]

    def timed_pack(fn):
        best = float("inf")
        for _ in range(args.reps):
            t = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t)
        return out, best * 1e3

    try:  # (oneDNN's bf16 linear needs AVX-512 or AVX-NE-CONVERT)
        onednn, _ = timed_pack(lambda: [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights])
        onednn, onednn_ms = timed_pack(lambda: [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights])
    except RuntimeError as e:
        print(f"oneDNN's prepacked linear is not available here: {str(e).splitlines()[0]}")
        onednn, onednn_ms = None, float("nan")
    # ours: (column name, packed weights or None for the plain ones, kernel) where this CPU has them
    ours, pack_ms, one_call_ms, cast_ms, cast_copy_ms = [], float("nan"), float("nan"), float("nan"), (float("nan"),) * 2

    def our_pack(fn: str):  # (packed weights, ms one call a weight, ms all in one call)
        pack = getattr(ext, fn)
        packed = [pack(w) for w in weights]
        packed, ms = timed_pack(lambda: [pack(w, p) for w, p in zip(weights, packed)])
        return packed, ms, timed_pack(lambda: ext.write_many(weights, packed, [fn] * len(weights)))[1]

    masters = [w.float() for w in weights] if dtype == torch.bfloat16 else []

    def cast_pack(fn: str, packed) -> float:  # ms: float32 masters cast on the way, all in one call
        return timed_pack(lambda: ext.write_many(masters, packed, [fn] * len(weights)))[1]

    def cast_copy() -> tuple[float, float]:  # ms: the masters cast into plain bf16 tensors, write_many / torch
        plain = [torch.empty_like(w).view(-1) for w in weights]
        flat = [m.view(-1) for m in masters]
        return (timed_pack(lambda: ext.write_many(flat, plain, [""] * len(flat)))[1],
                timed_pack(lambda: [p.copy_(m) for p, m in zip(plain, flat)])[1])

    if ext is not None and dtype == torch.bfloat16 and ext.bf16_vnni_supported():
        packed, pack_ms, one_call_ms = our_pack("bf16_vnni_pack")
        cast_ms, cast_copy_ms = cast_pack("bf16_vnni_pack", packed), cast_copy()
        ours.append(("dot", packed, ext.bf16_vnni_linear))
        if ext.bf16_amx_supported():
            ours.append(("AMX", packed, ext.bf16_amx_linear))
    elif ext is not None and dtype == torch.bfloat16 and ext.f32_panel_supported():
        packed, pack_ms, one_call_ms = our_pack("bf16_panel_pack")
        cast_ms, cast_copy_ms = cast_pack("bf16_panel_pack", packed), cast_copy()
        ours.append(("panels", packed, ext.bf16_panel_linear))
    if ext is not None and dtype == torch.float32:
        ours.append(("rows", None, lambda x, w, n: ext.invariant_linear(x, w, None)))
        if ext.f32_panel_supported():
            packed, pack_ms, one_call_ms = our_pack("f32_panel_pack")
            ours.append(("panels", packed, ext.f32_panel_linear))
    copies = [torch.empty_like(w) for w in weights]
    copy_ms = timed_pack(lambda: [c.copy_(w) for c, w in zip(copies, weights)])[1]
    print(f"pack 121 weights ({sum(w.nbytes for w in weights) / 1e6:.0f} MB): oneDNN reorder {onednn_ms:.1f} ms, "
          f"ours in place {pack_ms:.1f} ms (one call a weight), {one_call_ms:.1f} ms (all in one call)"
          + (f", {cast_ms:.1f} ms from float32 (cast on the way; a cast copy {cast_copy_ms[0]:.1f} ms, "
             f"torch's {cast_copy_ms[1]:.1f})" if dtype == torch.bfloat16 else "")
          + f"; Tensor.copy_ of the same bytes {copy_ms:.1f} ms")
    # the engine's path where ours is missing: oneDNN's prepacked linear, else F.linear
    baselines = [("F.linear", None, lambda x, w, n: F.linear(x, w))]
    if onednn is not None:
        baselines.append(("oneDNN", onednn, lambda x, p, n: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [],
                                                                                               "")))
    columns = baselines + ours
    print(f"{'rows':>5} | " + " | ".join(f"{n + ' ms':>11}" for n, _, _ in columns)
          + f" | best of ours vs {baselines[-1][0]}")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (H, INTER)}
        def step_of(fn, packed):
            return lambda: [fn(xs[w.shape[1]], w if p is None else p, w.shape[0])
                            for w, p in zip(weights, packed or [None] * len(weights))]

        times = ms_per_step([step_of(fn, packed) for _, packed, fn in columns], args.reps)
        ratio = f"{times[len(baselines) - 1] / min(times[len(baselines):]):.2f}x" if ours else "-"
        print(f"{m:>5} | " + " | ".join(f"{t:>11.1f}" for t in times) + f" | {ratio}")
    if not ours:
        print(f"(no kernel of ours for this dtype on this CPU: the engine uses {baselines[-1][0]} here)")


if __name__ == "__main__":
    main()
