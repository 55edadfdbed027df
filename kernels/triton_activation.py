"""Triton kernel for the Llama MLP's SiLU-and-multiply on CUDA; its torch reference is
kernels/activation.py's `silu_and_mul_ref` (same roundings: silu computed in float32 and rounded
to the dtype, the product rounded again). One kernel where the reference launches two (silu, mul)
and writes the silu half to memory between them: at batch 1 a decode step is launch-bound, and
every layer has one. Tested against the reference in Triton's interpreter on CPU
(TRITON_INTERPRET=1, tests/kernels/test_triton.py) and on a GPU when there is one.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * 2 * I + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * I + I + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu: float32 math, one rounding
    tl.store(out_ptr + row * I + offs, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) contiguous -> new contiguous (T, I)."""
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(I))
    _silu_and_mul_kernel[(T, triton.cdiv(I, block))](gate_up, out, I, BLOCK=block)
    return out
