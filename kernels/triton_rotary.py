"""Triton rotary embedding + KV-cache write on CUDA; its torch reference is kernels/rotary.py's
`rope_and_cache_ref`, Qwen3's per-head q/k RMSNorm (before the rotation) included. Same
semantics: the norm as kernels.norm.rms_norm_ref (float32 statistics, the normed value rounded
to the dtype, then times the weight in the dtype); cos/sin rows cast to the activations' dtype,
every product and sum rounded to it (bf16); the rotated k and the unrotated v of token t stored
at flat slot slot_mapping[t] of k_cache / v_cache (num_blocks, block_size, Hkv, D). One program
per (token, head), q heads first. Tested against the reference in Triton's interpreter on CPU
(tests/kernels/test_triton.py). head_dim must be a power of two.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rope_and_cache_kernel(qkv_ptr, pos_ptr, cs_ptr, slot_ptr, q_out, k_out, k_cache, v_cache, qn_ptr, kn_ptr, eps,
                           s_qkv, s_cs, s_slot, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                           QK_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    D: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dtype = q_out.dtype.element_ty
    cos = tl.load(cs_ptr + pos * s_cs + i).to(dtype).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + i).to(dtype).to(tl.float32)
    src = qkv_ptr + t * s_qkv + h * D  # q heads, then k heads: contiguous in the qkv row
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    if QK_NORM:  # the head's RMSNorm (q_norm for q heads, k_norm for k heads)
        w_ptr = qn_ptr if h < HQ else kn_ptr
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        x1 = (tl.load(w_ptr + i).to(tl.float32) * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (tl.load(w_ptr + HALF + i).to(tl.float32) * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # HF's q * cos + rotate_half(q) * sin in the dtype: each product and the sum rounded
    lo = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    hi = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    if h < HQ:
        dst = q_out + (t * HQ + h) * D
        tl.store(dst + i, lo)
        tl.store(dst + HALF + i, hi)
    else:
        kh = h - HQ
        dst = k_out + (t * HKV + kh) * D
        tl.store(dst + i, lo)
        tl.store(dst + HALF + i, hi)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        cache = k_cache + slot * s_slot + kh * D
        tl.store(cache + i, lo)
        tl.store(cache + HALF + i, hi)
        v_src = qkv_ptr + t * s_qkv + (HQ + HKV + kh) * D
        v_dst = v_cache + slot * s_slot + kh * D
        tl.store(v_dst + i, tl.load(v_src + i))
        tl.store(v_dst + HALF + i, tl.load(v_src + HALF + i))


def rope_and_cache(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads: int,
                   num_kv_heads: int, head_dim: int, q_norm=None, k_norm=None,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """See kernels.rotary.rope_and_cache_ref. Returns new contiguous q (T, Hq, D) and k (T, Hkv, D)."""
    T = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cos_sin_cache.is_contiguous() and k_cache.is_contiguous() \
        and v_cache.is_contiguous(), "contiguous qkv rows, cos/sin cache and K/V caches"
    assert (q_norm is None) == (k_norm is None), "q_norm and k_norm come together"
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T:
        norms = (q_norm, k_norm) if q_norm is not None else (qkv, qkv)  # (unread without QK_NORM)
        _rope_and_cache_kernel[(T, num_heads + num_kv_heads)](
            qkv, positions, cos_sin_cache, slot_mapping, q, k, k_cache, v_cache, *norms, float(eps), qkv.stride(0),
            cos_sin_cache.stride(0), k_cache.stride(1), HQ=num_heads, HKV=num_kv_heads, HALF=head_dim // 2,
            QK_NORM=q_norm is not None)
    return q, k
