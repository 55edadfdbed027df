"""Paged decode attention: pure-torch reference vs the C++ CPU op, ms per call.

Shape: the engine's typical decode call (num_heads=9, num_kv_heads=3, head_dim=64,
block_size=16), every sequence at the same length, blocks scattered at random.
Run from the repo root:  .venv/bin/python benchmarks/kernels_attention.py [--threads N]
Timings are only meaningful on an otherwise idle machine: with more busy threads than cores,
every OpenMP-parallel call (torch's and ours) waits for descheduled threads (~100x slower).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import cpu_ext  # noqa: E402
from kernels.attention import paged_decode_attention_ref  # noqa: E402
from timing import ms_per_call  # noqa: E402  (benchmarks/timing.py)

H, KVH, D, BS = 9, 3, 64, 16


def make_inputs(B, seq_len, dtype, gen):
    n_blk = (seq_len + BS - 1) // BS
    num_blocks = B * n_blk + 8
    kv = torch.randn(2, num_blocks, BS, KVH, D, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:B * n_blk].reshape(B, n_blk).int()
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    lens = torch.full((B,), seq_len, dtype=torch.int32)
    return q, kv[0], kv[1], table, lens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    if (threads := parser.parse_args().threads) is not None:
        torch.set_num_threads(threads)
    ext = cpu_ext.load()
    gen = torch.Generator().manual_seed(0)
    scale = D ** -0.5
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"H={H} KVH={KVH} D={D} block_size={BS}")
    print(f"{'dtype':>8} {'B':>4} {'seq':>4} {'torch ms':>9} {'C++ ms':>8} {'speedup':>8}")
    for dtype in (torch.bfloat16, torch.float32):
        for B in (1, 32, 128):
            for seq_len in (64, 128, 256):
                args = make_inputs(B, seq_len, dtype, gen)
                t_ref = ms_per_call(lambda: paged_decode_attention_ref(*args, scale))
                if ext is None:
                    print(f"{str(dtype)[6:]:>8} {B:>4} {seq_len:>4} {t_ref:>9.3f} {'n/a':>8}")
                    continue
                t_ext = ms_per_call(lambda: ext.paged_decode_attention(*args, scale, 0))
                print(f"{str(dtype)[6:]:>8} {B:>4} {seq_len:>4} {t_ref:>9.3f} {t_ext:>8.3f} "
                      f"{t_ref / t_ext:>7.1f}x")


if __name__ == "__main__":
    main()
