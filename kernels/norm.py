"""RMSNorm (Hugging Face LlamaRMSNorm semantics), with and without a fused residual add.

  rms_norm(x, weight, eps)                      = weight * to_dtype(x32 * rsqrt(mean(x32^2) + eps))
  fused_add_rms_norm(x, residual, weight, eps)  = (rms_norm(r, weight, eps), r),  r = residual + x
                                                  (r = x when residual is None)

x32 is x in float32; the residual add happens in x's dtype (one rounding of the float32 sum, as
torch's bf16 add), and the norm is taken of the rounded sum. `weight * ...` runs in the dtype
(a second rounding for bf16). The `_ref` functions are those torch ops, for any device; the
dispatchers run the C++ op of kernels/csrc/fused_ops.cpp on CPU when the extension builds (it
reproduces the references bit for bit on AVX-512 CPUs, see the .cpp), the Triton kernel of
kernels/triton_norm.py on CUDA (when triton is installed), else the reference.
"""
import functools

import torch

from . import cpu_ext


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm.forward over the last dim, op for op (float32 statistics)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_ref(residual + x), residual + x); residual None means a residual of x itself."""
    new_residual = x if residual is None else residual + x
    return rms_norm_ref(new_residual, weight, eps), new_residual


def _ext_for(x: torch.Tensor, weight: torch.Tensor):
    """The extension module if its C++ op takes these tensors, else None (cheap checks only)."""
    return cpu_ext.ops_for(x.device, x.dtype) if weight.dtype == x.dtype else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; x may be a strided view with a contiguous last dim (e.g.
    per-head q/k norms over a (T, heads, head_dim) slice of qkv). Returns a new contiguous tensor."""
    if 1 <= x.ndim <= 3 and x.stride(-1) == 1 and weight.is_contiguous():
        ext = _ext_for(x, weight)
        if ext is not None:
            return ext.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: (T, H) (last dim contiguous). Returns new tensors (normed, residual + x);
    with residual None, (rms_norm(x), x)."""
    if (x.ndim == 2 and x.stride(-1) == 1 and weight.is_contiguous()
            and (residual is None or (residual.dtype == x.dtype and residual.is_cpu
                                      and residual.stride(-1) == 1))):
        ext = _ext_for(x, weight)
        if ext is not None:
            return ext.fused_add_rms_norm(x, residual, weight, eps)
    if x.is_cuda and x.ndim == 2 and weight.dtype == x.dtype and triton_available():
        from kernels import triton_norm

        return triton_norm.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernels (kernels/triton_*.py; CUDA) can run: triton is installed. Asked
    by every CUDA dispatch (each layer's ops), so looked up once."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None
