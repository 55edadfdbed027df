"""The decode step's matmuls on CPU: one model-sized step of SmolLM2-135M's 121 projections (30
layers x qkv, o, gate_up, down, and the LM head; random bf16 weights) at a given number of rows,
ms per step, through
  F.linear     torch's bf16 matmul (throughput.py's "floor"),
  oneDNN       torch.ops.mkldnn on weights prepacked once (the engine's bf16 path before
               kernels/csrc/vnni_linear.cpp, and still its path on CPUs without AVX-512 BF16),
  ours         bf16_vnni_linear on weights packed by bf16_vnni_pack (the engine's bf16 path on
               CPUs with AVX-512 BF16),
  AMX          bf16_amx_linear on the same packed weights (CPUs with AMX: Xeons from Sapphire
               Rapids on; the engine takes it for steps of more rows than vnni_linear wins at).
Run from the repo root:  .venv/bin/python benchmarks/kernels_matmul.py [--rows 1 4 16 32 128]
The weights (~270 MB per copy, three copies) do not fit in cache: each step streams them from
memory, as a decode step does. Compare the columns of one run; the host's speed moves between runs.
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


def ms_per_step(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(machine_line(), f"torch threads {torch.get_num_threads()}")
    ext = cpu_ext.load()
    vnni = ext is not None and ext.bf16_vnni_supported()
    g = torch.Generator().manual_seed(0)
    print("packing 121 weights ...", file=sys.stderr, flush=True)
    weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    ours = [ext.bf16_vnni_pack(w) for w in weights] if vnni else None
    amx = vnni and ext.bf16_amx_supported()
    print(f"{'rows':>5} | {'F.linear ms':>11} | {'oneDNN ms':>9} | {'ours ms':>7} | {'AMX ms':>6} | best of ours vs oneDNN")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (H, INTER)}
        t_lin = ms_per_step(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], args.reps)
        t_dnn = ms_per_step(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                     for w, p in zip(weights, onednn)], args.reps)
        t_ours = ms_per_step(lambda: [ext.bf16_vnni_linear(xs[w.shape[1]], p, w.shape[0])
                                      for w, p in zip(weights, ours)], args.reps) if vnni else float("nan")
        t_amx = ms_per_step(lambda: [ext.bf16_amx_linear(xs[w.shape[1]], p, w.shape[0])
                                     for w, p in zip(weights, ours)], args.reps) if amx else float("nan")
        best = min(t_ours, t_amx) if amx else t_ours
        print(f"{m:>5} | {t_lin:>11.1f} | {t_dnn:>9.1f} | {t_ours:>7.1f} | {t_amx:>6.1f} | {t_dnn / best:.2f}x")
    if not vnni:
        print("(no AVX-512 BF16 on this CPU: the engine uses oneDNN for bf16 here)")


if __name__ == "__main__":
    main()
