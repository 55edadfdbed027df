"""Rotary position embeddings (NeoX / Hugging Face "rotate_half" layout) and the scaling variants
of the Llama, Qwen2/3 and Mistral families: default, linear, llama3, yarn.

Frequencies follow transformers' `modeling_rope_utils` formula for formula, so float32 results
agree bit for bit with the reference.
"""
import math

import torch

from . import cpu_ext
from .kv_quant import SCALE_BYTES, is_codes, quantize_rows
from .norm import triton_available

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim // 2,) float32 and the attention factor that scales cos/sin."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    dim = int(head_dim * scaling.get("partial_rotary_factor", 1.0))
    assert dim == head_dim, "partial rotary embeddings are not supported"
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    factor, orig_len = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def rope_cos_sin_cache(inv_freq: torch.Tensor, attention_factor: float, max_len: int) -> torch.Tensor:
    """(max_len, 2, head_dim // 2) float32: cos and sin per position."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (L, D/2)
    return torch.stack([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D) (may be a strided view); cos, sin: (T, 1, D/2) in x's dtype. Returns (T, H, D).

    out[:D/2] = x1*cos - x2*sin, out[D/2:] = x2*cos + x1*sin (HF's q*cos + rotate_half(q)*sin).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
    torch.add(x2 * cos, x1 * sin, out=out[..., half:])
    return out


# ---- fused RoPE + KV-cache write ----------------------------------------------------------------
# q, k rotated as HF's apply_rotary_pos_emb in the activations' dtype: cos/sin (float32 cache rows)
# are cast to the dtype, and for bf16 every product and sum is rounded to bf16. The rotated k and
# the unrotated v of token t are stored in k_cache / v_cache (num_blocks, block_size, Hkv, D),
# contiguous (e.g. kv[layer, 0]), at flat slot slot_mapping[t] = block * block_size + offset;
# slots must be distinct. The dispatchers run the C++ op (kernels/csrc/fused_ops.cpp) on CPU when
# the extension builds, the Triton kernel (kernels/triton_rotary.py) on CUDA for rope_and_cache,
# else the reference.

def _write_kv_ref(k_cache, v_cache, k, v, slot_mapping):
    if is_codes(k_cache):  # int8 rows: the values quantized (kernels/kv_quant.py)
        k, v = quantize_rows(k), quantize_rows(v)
    num_kv_heads, row = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, v)


def rope_and_cache_qk_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """q (T, Hq, D), k and v (T, Hkv, D), any strides; positions (T,) ints; cos_sin_cache
    (max_pos, 2, D/2) float32 (rope_cos_sin_cache). Writes the cache; returns new contiguous
    rotated (q, k). Any device."""
    cs = cos_sin_cache[positions].to(q.dtype)  # (T, 2, D/2)
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    _write_kv_ref(k_cache, v_cache, k, v, slot_mapping)
    return q, k


def rope_and_cache_ref(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads: int,
                       num_kv_heads: int, head_dim: int, q_norm=None, k_norm=None, eps: float = 1e-6):
    """qkv (T, (Hq + 2 * Hkv) * D) = [q | k | v] per token. With q_norm / k_norm ((D,) weights,
    Qwen3), q and k first get a per-head RMSNorm (kernels.norm.rms_norm_ref). Returns (q, k)."""
    from .norm import rms_norm_ref

    T = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(T, num_heads, head_dim)
    k = qkv[:, q_size: q_size + kv_size].view(T, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(T, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    return rope_and_cache_qk_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def _rope_ext(x, cos_sin_cache, k_cache):
    """The extension module if its C++ op takes these tensors, else None (cheap checks only;
    the op itself rejects malformed inputs, such as non-contiguous caches, with a RuntimeError)."""
    codes_ok = is_codes(k_cache) and (k_cache.shape[-1] - SCALE_BYTES) % 16 == 0  # (the op's int8 rows)
    cache_ok = k_cache.dtype == x.dtype or codes_ok
    if cache_ok and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous():
        return cpu_ext.ops_for(x.device, x.dtype)
    return None


def _long(t):
    return t if t.dtype == torch.int64 else t.long()


def rope_and_cache(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads: int,
                   num_kv_heads: int, head_dim: int, q_norm=None, k_norm=None, eps: float = 1e-6):
    """See rope_and_cache_ref. Returns new contiguous q (T, Hq, D) and k (T, Hkv, D)."""
    if (qkv.ndim == 2 and qkv.stride(-1) == 1 and cpu_ext.supports_head_dim("rotary", head_dim)
            and (q_norm is None or (q_norm.dtype == qkv.dtype and k_norm.dtype == qkv.dtype))):
        ext = _rope_ext(qkv, cos_sin_cache, k_cache)
        if ext is not None:
            return ext.rope_and_cache(qkv, _long(positions), cos_sin_cache, k_cache, v_cache,
                                      _long(slot_mapping), num_heads, num_kv_heads, head_dim,
                                      q_norm, k_norm, eps)
    if (qkv.is_cuda and qkv.stride(-1) == 1 and head_dim & (head_dim - 1) == 0 and not is_codes(k_cache)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and triton_available()):
        from kernels import triton_rotary

        return triton_rotary.rope_and_cache(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                            num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps)
    return rope_and_cache_ref(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                              num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps)


def rope_and_cache_qk(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """See rope_and_cache_qk_ref (q, k, v may be strided views with a contiguous last dim)."""
    if (q.ndim == 3 and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and k.dtype == q.dtype and v.dtype == q.dtype and cpu_ext.supports_head_dim("rotary", q.shape[-1])):
        ext = _rope_ext(q, cos_sin_cache, k_cache)
        if ext is not None:
            return ext.rope_and_cache_qk(q, k, v, _long(positions), cos_sin_cache, k_cache, v_cache,
                                         _long(slot_mapping))
    return rope_and_cache_qk_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
