"""SiLU-and-multiply of the Llama MLP: down(silu(gate) * up) with gate_up = [gate | up].

  silu_and_mul(gate_up) = silu(gate_up[..., :I]) * gate_up[..., I:]

in the dtype of gate_up: F.silu rounds its (float32-computed) result to the dtype, and the
product is rounded again, exactly as HF's `act_fn(gate_proj(x)) * up_proj(x)`. The dispatcher
runs the C++ op (kernels/csrc/fused_ops.cpp) on CPU when the extension builds, the Triton kernel
(kernels/triton_activation.py) on CUDA when triton is installed, else the reference.
"""
import torch
import torch.nn.functional as F

from . import cpu_ext
from .norm import triton_available


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I) -> (..., I), any device."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) with a contiguous last dim -> new contiguous (T, I)."""
    if gate_up.ndim == 2 and gate_up.stride(-1) == 1:
        ext = cpu_ext.ops_for(gate_up.device, gate_up.dtype)
        if ext is not None:
            return ext.silu_and_mul(gate_up)
        if gate_up.is_cuda and gate_up.is_contiguous() and triton_available():
            from kernels import triton_activation

            return triton_activation.silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)
