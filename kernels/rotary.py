"""Rotary position embeddings (NeoX / Hugging Face "rotate_half" layout) and the scaling variants
of the Llama, Qwen2/3 and Mistral families: default, linear, llama3, yarn.

Frequencies follow transformers' `modeling_rope_utils` formula for formula, so float32 results
agree bit for bit with the reference.
"""
import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> tuple[torch.Tensor, float]:
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
