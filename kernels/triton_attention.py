"""Triton paged decode attention on CUDA (one query token per sequence, GQA, block tables,
sliding window); its torch reference is kernels/attention.py's `paged_decode_attention_ref`,
with the same arguments and layout (see that module's docstring). One program per (sequence,
query head) walks the sequence's blocks with an online softmax in float32. Tested against the
reference in Triton's interpreter on CPU (TRITON_INTERPRET=1, tests/kernels/test_triton.py) and
on a GPU when there is one. head_dim and block_size must be powers of two.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale, window,
                         sq_b, sq_h, sk_block, sk_tok, sk_head, sv_block, sv_tok, sv_head, st_b,
                         so_b, so_h, GROUP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // GROUP
    length = tl.load(lens_ptr + b)
    start = 0
    if window > 0:
        start = tl.maximum(length - window, 0)
    d = tl.arange(0, D)
    tok = tl.arange(0, BS)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + d).to(tl.float32)
    m = -float("inf")
    denom = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    for j in range(start // BS, tl.cdiv(length, BS)):
        block = tl.load(table_ptr + b * st_b + j).to(tl.int64)
        t = j * BS + tok
        valid = (t < length) & (t >= start)
        k = tl.load(k_ptr + block * sk_block + tok[:, None] * sk_tok + kvh * sk_head + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + block * sv_block + tok[:, None] * sv_tok + kvh * sv_head + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / denom
    tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window=None):
    B, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "contiguous head_dim"
    out = torch.empty_like(q)
    _paged_decode_kernel[(B, H)](
        q, k_cache, v_cache, block_table, seq_lens, out, float(scale), int(sliding_window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), GROUP=H // KVH, BS=bs, D=D)
    return out
