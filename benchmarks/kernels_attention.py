"""Paged attention on CPU, ms per call: decode (pure-torch reference vs the C++ op, the op also
from a cold cache, as it runs in a decode step after the layer's matmuls, and from a cold int8
cache, kv_cache_dtype "int8": the same keys and values in about half the bytes), then prefill
(torch's SDPA one prompt at a time over its gathered blocks, the engine's path before the C++
op and its fallback without a compiler, vs the C++ paged_prefill_attention over the whole step).

Shape: the engine's (num_heads=9, num_kv_heads=3, head_dim=64, block_size=16), blocks scattered
at random; decode: every sequence at the same length; prefill: B prompts of L new tokens after
C cached ones.
Run from the repo root:  .venv/bin/python benchmarks/kernels_attention.py [--threads N]

--device cuda instead times the Triton decode kernel (kernels/triton_attention.py) on a GPU at a
~1B Llama's shape (32 query heads, 8 KV heads, head_dim 64, blocks of 16), bf16, for several key
counts a step (block_n), microseconds a call from CUDA-graph replays, as a decode step runs it.
Timings are only meaningful on an otherwise idle machine: with more busy threads than cores,
every OpenMP-parallel call (torch's and ours) waits for descheduled threads (~100x slower).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import cpu_ext  # noqa: E402
from kernels.attention import _prefill_sdpa, paged_decode_attention_ref  # noqa: E402
from kernels.kv_quant import quantize_rows  # noqa: E402
from timing import machine_line, ms_per_call, ms_per_cold_call  # noqa: E402  (benchmarks/timing.py)

H, KVH, D, BS = 9, 3, 64, 16


def make_inputs(B, seq_len, dtype, gen):
    n_blk = (seq_len + BS - 1) // BS
    num_blocks = B * n_blk + 8
    kv = torch.randn(2, num_blocks, BS, KVH, D, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:B * n_blk].reshape(B, n_blk).int()
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    lens = torch.full((B,), seq_len, dtype=torch.int32)
    return q, kv[0], kv[1], table, lens


def cuda_decode():
    import triton.testing

    from kernels import triton_attention

    h, kvh, d, bs = 32, 8, 64, 16
    block_ns = (16, 32, 64, 128)
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}; H={h} KVH={kvh} D={d} block_size={bs}, bf16")
    print("us n=N: the decode kernel taking N keys a step; prefill: the prefill kernel on the same decode "
          "(one program per KV head: each key read once for its 4 query heads)")
    print(f"{'B':>4} {'seq':>5} " + " ".join(f"{f'us n={n}':>10}" for n in block_ns) + f" {'prefill':>10}")
    for B in (1, 8, 32, 256):
        for seq_len in (128, 512, 2048):
            n_blk = (seq_len + bs - 1) // bs
            kv = torch.randn(2, B * n_blk + 8, bs, kvh, d, generator=gen).to("cuda", torch.bfloat16)
            table = torch.randperm(B * n_blk + 8, generator=gen)[:B * n_blk].reshape(B, n_blk).int().cuda()
            q = torch.randn(B, h, d, generator=gen).to("cuda", torch.bfloat16)
            lens = torch.full((B,), seq_len, dtype=torch.int32, device="cuda")
            times = []
            for n in block_ns:
                def call(n=n):
                    triton_attention.paged_decode_attention(q, kv[0], kv[1], table, lens, d ** -0.5, None, n)
                call()
                times.append(1e3 * triton.testing.do_bench_cudagraph(call, rep=50))
            cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")

            def prefill():
                triton_attention.paged_prefill_attention(q, kv[0], kv[1], table, cu, lens, d ** -0.5)
            prefill()
            times.append(1e3 * triton.testing.do_bench_cudagraph(prefill, rep=50))
            print(f"{B:>4} {seq_len:>5} " + " ".join(f"{t:>10.1f}" for t in times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        return cuda_decode()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ext = cpu_ext.load()
    gen = torch.Generator().manual_seed(0)
    scale = D ** -0.5
    print(machine_line())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"H={H} KVH={KVH} D={D} block_size={BS}")
    print(f"{'dtype':>8} {'B':>4} {'seq':>4} {'torch ms':>9} {'C++ ms':>8} {'speedup':>8} {'C++ cold':>9} "
          f"{'int8 cold':>9} {'int8 gain':>9}")
    # + long windows of a few sequences: a rollout's tail, where one or two long generations are
    # left and the kernel cuts each window into parts so they use every thread
    cases = [(B, n) for B in (1, 32, 128) for n in (64, 128, 256)] + [(1, 2048), (1, 8192), (2, 4096)]
    for dtype in (torch.bfloat16, torch.float32):
        for B, seq_len in cases:
            args = make_inputs(B, seq_len, dtype, gen)
            t_ref = ms_per_call(lambda: paged_decode_attention_ref(*args, scale))
            if ext is None:
                print(f"{str(dtype)[6:]:>8} {B:>4} {seq_len:>4} {t_ref:>9.3f} {'n/a':>8}")
                continue
            t_ext = ms_per_call(lambda: ext.paged_decode_attention(*args, scale, 0))
            t_cold = ms_per_cold_call(lambda: ext.paged_decode_attention(*args, scale, 0))
            q, k, v, table, lens = args
            codes = (q, quantize_rows(k), quantize_rows(v), table, lens)
            t_int8 = ms_per_cold_call(lambda: ext.paged_decode_attention(*codes, scale, 0))
            print(f"{str(dtype)[6:]:>8} {B:>4} {seq_len:>4} {t_ref:>9.3f} {t_ext:>8.3f} "
                  f"{t_ref / t_ext:>7.1f}x {t_cold:>9.3f} {t_int8:>9.3f} {t_cold / t_int8:>8.2f}x")
    print(f"\nprefill\n{'dtype':>8} {'B':>4} {'L':>5} {'C':>5} {'SDPA ms':>9} {'C++ ms':>8} {'speedup':>8}")
    for dtype in (torch.bfloat16, torch.float32):
        for B, new_tokens, cached in ((16, 128, 0), (4, 512, 512), (1, 2048, 0), (1, 2048, 2048)):
            q, k_cache, v_cache, table, _ = make_inputs(B, cached + new_tokens, dtype, gen)
            q = torch.randn(B * new_tokens, H, D, generator=gen).to(dtype)
            cu = torch.arange(0, B * new_tokens + 1, new_tokens, dtype=torch.int32)
            lens = torch.full((B,), cached + new_tokens, dtype=torch.int32)
            args = (q, k_cache, v_cache, table, cu, lens, scale)
            t_sdpa = ms_per_call(lambda: _prefill_sdpa(*args))
            t_ext = ms_per_call(lambda: ext.paged_prefill_attention(*args, 0)) if ext is not None else float("nan")
            print(f"{str(dtype)[6:]:>8} {B:>4} {new_tokens:>5} {cached:>5} {t_sdpa:>9.2f} {t_ext:>8.2f} "
                  f"{t_sdpa / t_ext:>7.1f}x")


if __name__ == "__main__":
    main()
