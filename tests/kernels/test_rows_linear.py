"""bf16_rows_linear (kernels/csrc/rows_linear.cpp), the bf16 matmul for steps of few rows,
against its torch reference: float32 sums of the bf16 inputs, the bias added in float32,
rounded to bf16 once. The order of the float32 sums differs, so an output may land one bf16
step away when the exact sum sits on a rounding boundary: almost all must be equal, all within
one step."""
import pytest
import torch

from kernels import cpu_ext

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(ext is None, reason="the C++ CPU kernels did not build here")


def reference(x, w, b):
    y = x.float() @ w.float().T
    return (y if b is None else y + b.float()).bfloat16()


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N,K", [(4, 32), (7, 33), (64, 576), (30, 1536), (5, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float32_reference(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    got, want = ext.bf16_rows_linear(x, w, b), reference(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    assert (got == want).float().mean() >= 0.98
    step = want.float().abs().clamp_min(1e-3) * 2 ** -7  # one bf16 step
    assert ((got.float() - want.float()).abs() <= step + 1e-6).all()


def test_strided_rows_and_bad_input():
    x = torch.randn(3, 128).bfloat16()[:, :64]  # rows with a stride: a view of a wider tensor
    w = torch.randn(16, 64).bfloat16()
    assert torch.equal(ext.bf16_rows_linear(x, w), ext.bf16_rows_linear(x.contiguous(), w))
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        ext.bf16_rows_linear(x.float(), w.float())
    with pytest.raises(RuntimeError, match="K"):
        ext.bf16_rows_linear(torch.randn(2, 8).bfloat16(), w)
