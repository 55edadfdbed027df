"""Triton kernel for the fused residual add + RMSNorm on CUDA; its torch reference is
kernels/norm.py's `fused_add_rms_norm_ref` (same semantics: the add rounded to the dtype, the
norm of the rounded sum in float32, `weight * normed.to(dtype)` in the dtype). One program per
row. Tested against the reference in Triton's interpreter on CPU (TRITON_INTERPRET=1,
tests/kernels/test_triton.py) and on a GPU when there is one.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, H, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * H + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # torch's add: one rounding to the dtype
    tl.store(new_res_ptr + row * H + offs, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / H
    h = h * tl.rsqrt(variance + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * h.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * H + offs, y.to(x.dtype), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for contiguous (T, H) tensors."""
    T, H = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    res = residual.contiguous() if residual is not None else x
    _add_rms_norm_kernel[(T,)](x, res, weight, out, new_residual, H, eps,
                               HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(H))
    return out, new_residual
