"""Fused small ops (RMSNorm + residual, SiLU-and-mul, RoPE + KV-cache write): ms per call of
  torch ops   what engine/model/decoder.py did before the fused ops (e.g. `residual + h` then
              F.rms_norm; F.silu(gate) * up; apply_rope + two index_copy_ into the cache;
              the per-step cos/sin gather, shared by all layers, is not counted),
  reference   the pure-torch references (kernels/norm.py, activation.py, rotary.py),
  C++         the extension's op called directly (ext.fused_add_rms_norm(...)),
  dispatch    the public Python dispatcher (kernels.norm.fused_add_rms_norm(...)) = C++ + checks.

Shapes: SmolLM2-135M (hidden 576, 9 q / 3 kv heads, head_dim 64, intermediate 1536), block
size 16, distinct random slots. The qk-norm rows use the same shapes with Qwen3's per-head norm.
Run from the repo root:  .venv/bin/python benchmarks/kernels_fused.py [--threads N] [--T 1 32 512]
Timings are only meaningful on an otherwise idle machine: with more busy threads than cores,
every OpenMP-parallel call (torch's and ours) waits for descheduled threads.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from timing import ms_per_call  # noqa: E402  (benchmarks/timing.py)

from kernels import activation, cpu_ext, norm, rotary

H, HQ, HKV, D, I, BS = 576, 9, 3, 64, 1536, 16
EPS = 1e-5


def write_kv(k_cache, v_cache, k, v, slots):  # engine/attention.write_kv
    k_cache.view(-1, HKV, D).index_copy_(0, slots, k)
    v_cache.view(-1, HKV, D).index_copy_(0, slots, v)


def cases(T, dtype, gen, ext):
    """(name, torch-ops fn, reference fn, C++ fn or None, dispatcher fn) per op."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    x, res, w = rnd(T, H), rnd(T, H), rnd(H)
    gate_up = rnd(T, 2 * I)
    qkv = rnd(T, (HQ + 2 * HKV) * D)
    n_blocks = max(64, 2 * T // BS + 8)
    kv = rnd(2, n_blocks, BS, HKV, D)
    k_cache, v_cache = kv[0], kv[1]
    slots = torch.randperm(n_blocks * BS, generator=gen)[:T]
    positions = torch.randint(0, 2048, (T,), generator=gen)
    cos_sin = rotary.rope_cos_sin_cache(*rotary.rope_inv_freq(D, 100000.0, None), 4096)
    qn, kn = rnd(D), rnd(D)
    cs = cos_sin[positions].to(dtype)
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    q_size, kv_size = HQ * D, HKV * D

    def torch_add_norm():
        r = res + x
        return F.rms_norm(r, (H,), w, EPS), r

    def torch_silu():
        return F.silu(gate_up[:, :I]) * gate_up[:, I:]

    def torch_rope():
        qk = rotary.apply_rope(qkv[:, : q_size + kv_size].view(T, HQ + HKV, D), cos, sin)
        q, k = qk[:, :HQ], qk[:, HQ:]
        write_kv(k_cache, v_cache, k, qkv[:, q_size + kv_size:].view(T, HKV, D), slots)
        return q, k

    def torch_rope_qknorm():
        q = F.rms_norm(qkv[:, :q_size].view(T, HQ, D), (D,), qn, EPS)
        k = F.rms_norm(qkv[:, q_size: q_size + kv_size].view(T, HKV, D), (D,), kn, EPS)
        q, k = rotary.apply_rope(q, cos, sin), rotary.apply_rope(k, cos, sin)
        write_kv(k_cache, v_cache, k, qkv[:, q_size + kv_size:].view(T, HKV, D), slots)
        return q, k

    rope_args = (qkv, positions, cos_sin, k_cache, v_cache, slots, HQ, HKV, D)
    return [
        ("add_rms_norm", torch_add_norm,
         lambda: norm.fused_add_rms_norm_ref(x, res, w, EPS),
         ext and (lambda: ext.fused_add_rms_norm(x, res, w, EPS)),
         lambda: norm.fused_add_rms_norm(x, res, w, EPS)),
        ("rms_norm", lambda: F.rms_norm(x, (H,), w, EPS),
         lambda: norm.rms_norm_ref(x, w, EPS),
         ext and (lambda: ext.rms_norm(x, w, EPS)),
         lambda: norm.rms_norm(x, w, EPS)),
        ("silu_and_mul", torch_silu,
         lambda: activation.silu_and_mul_ref(gate_up),
         ext and (lambda: ext.silu_and_mul(gate_up)),
         lambda: activation.silu_and_mul(gate_up)),
        ("rope_and_cache", torch_rope,
         lambda: rotary.rope_and_cache_ref(*rope_args),
         ext and (lambda: ext.rope_and_cache(*rope_args)),
         lambda: rotary.rope_and_cache(*rope_args)),
        ("rope+qk_norm", torch_rope_qknorm,
         lambda: rotary.rope_and_cache_ref(*rope_args, qn, kn, EPS),
         ext and (lambda: ext.rope_and_cache(*rope_args, qn, kn, EPS)),
         lambda: rotary.rope_and_cache(*rope_args, qn, kn, EPS)),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--T", type=int, nargs="+", default=[1, 32, 512], help="tokens per call")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ext = cpu_ext.load()
    if ext is not None and not hasattr(ext, "rms_norm"):
        ext = None
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, hidden={H} "
          f"heads={HQ}/{HKV} head_dim={D} intermediate={I}")
    print(f"{'op':>15} {'dtype':>8} {'T':>4} {'torch ops ms':>12} {'reference ms':>12} "
          f"{'C++ ms':>8} {'dispatch ms':>11} {'speedup':>8}")
    for dtype in (torch.bfloat16, torch.float32):
        for T in args.T:
            for name, f_torch, f_ref, f_ext, f_disp in cases(T, dtype, gen, ext):
                t_torch, t_ref = ms_per_call(f_torch), ms_per_call(f_ref)
                if f_ext is None:
                    print(f"{name:>15} {str(dtype)[6:]:>8} {T:>4} {t_torch:>12.4f} {t_ref:>12.4f} "
                          f"{'n/a':>8}")
                    continue
                t_ext, t_disp = ms_per_call(f_ext), ms_per_call(f_disp)
                print(f"{name:>15} {str(dtype)[6:]:>8} {T:>4} {t_torch:>12.4f} {t_ref:>12.4f} "
                      f"{t_ext:>8.4f} {t_disp:>11.4f} {t_torch / t_ext:>7.1f}x")


if __name__ == "__main__":
    main()
