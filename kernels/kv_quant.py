"""int8 KV-cache rows (EngineConfig.kv_cache_dtype "int8").

A cache row (one token's key or value of one kv head) is head_dim int8 codes followed by its
float32 scale, 4 bytes: the cache is int8 (num_blocks, block_size, num_kv_heads, head_dim + 4),
value = code * scale with scale = max|x| / 127 over the row, codes rounded half to even. One
scale per (token, kv head) keeps a row self-contained (written once, by itself, read without
other state) at 4 bytes in head_dim + 4; the error of a value is at most scale / 2. The C++
kernels (kernels/csrc/vec.h) read and write the same bytes; these are the references.
"""
import torch

SCALE_BYTES = 4


def row_size(head_dim: int, codes: bool) -> int:
    """Elements of one cache row."""
    return head_dim + SCALE_BYTES if codes else head_dim


def is_codes(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., D) float32 / bf16 -> int8 (..., D + 4) cache rows."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # (a tensor numerator: `127.0 / amax` is reciprocal-then-multiply in torch, one rounding more)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv).to(torch.int8)
    return torch.cat([codes, (amax / 127.0).contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 (..., D + 4) cache rows -> float32 (..., D)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # (..., 1)
    return rows[..., :-SCALE_BYTES].float() * scale
