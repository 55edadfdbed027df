"""The batch-invariant C++ ops: a row's result must be the same bits whatever rows come with it
(alone, first, last, in a batch of any size), and close to the float64 / torch reference."""
import numpy as np
import pytest
import torch

SLICES = [(0, 1), (3, 4), (5, 9), (1, 70), (0, 33), (17, 70), (66, 70), (0, 70)]


@pytest.mark.parametrize("K,N,bias", [(576, 960, False), (1536, 70, True), (37, 13, True), (16, 5, False),
                                      (1, 3, False), (100, 1, True)])
def test_invariant_linear_rows_do_not_depend_on_the_batch(ext, K, N, bias):
    g = torch.Generator().manual_seed(K * 1000 + N)
    x = torch.randn(70, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    full = ext.invariant_linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5 * K ** 0.5)
    for i, j in SLICES:
        assert torch.equal(ext.invariant_linear(x[i:j], w, b), full[i:j]), (i, j)
    # rows of a wider tensor (a strided view, as the model's column slices are)
    wide = torch.cat([x, torch.randn(70, 5, generator=g)], dim=1)[:, :K]
    assert torch.equal(ext.invariant_linear(wide, w, b), full)


def _fma32(a, b, c):
    """float32 a * b + c with one rounding, in numpy: the product is exact in float64, the sum's
    float64 rounding error is kept (TwoSum) and decides the float32 rounding where the float64
    sum landed exactly halfway between two float32 values (the one case double rounding breaks)."""
    p, c = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    t = p + c
    bv = t - p
    e = (p - (t - bv)) + (c - bv)
    r = t.astype(np.float32)
    r64 = r.astype(np.float64)
    toward = np.nextafter(r, np.where(t > r64, np.float32(np.inf), np.float32(-np.inf))).astype(np.float64)
    halfway = (t != r64) & ((r64 + toward) / 2 == t) & (e != 0)
    t = np.where(halfway, np.nextafter(t, t + e), t)
    return t.astype(np.float32)


def _invariant_linear_reference(x, w, b):
    """The summation order invariant_ops.cpp and f32_linear.cpp define, on every CPU: each output
    is one chain of FMAs over k = 0, 1, ..., K - 1 from zero, then + bias (+ 0 without one)."""
    x, w = x.numpy(), w.numpy()
    (M, K), N = x.shape, w.shape[0]
    acc = np.zeros((M, N), np.float32)
    for k in range(K):
        acc = _fma32(x[:, None, k], w[None, :, k], acc)
    return torch.from_numpy(acc + (b.numpy() if b is not None else np.float32(0)))


ORDER_CASES = [(5, 576, 9, False), (7, 37, 13, True), (3, 1, 2, False), (1, 1536, 4, True), (13, 64, 70, True)]


@pytest.mark.parametrize("M,K,N,bias", ORDER_CASES)
def test_invariant_linear_is_the_documented_summation_order(ext, M, K, N, bias):
    # The same bits on every CPU (AVX2 and AVX-512 builds tile differently): the exact order, emulated.
    g = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)  # mixed magnitudes: rounding matters
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    ref = _invariant_linear_reference(x, w, b)
    assert torch.equal(ext.invariant_linear(x, w, b), ref)
    if K >= 37:  # the reference can tell orders apart: a float64 dot rounded once differs in places
        assert not torch.equal(torch.nn.functional.linear(x.double(), w.double(),
                                                          None if b is None else b.double()).float(), ref)


@pytest.mark.parametrize("M,K,N,bias", ORDER_CASES + [(70, 576, 200, True)])
def test_invariant_linear_gives_the_float32_panels_bits(ext, M, K, N, bias):
    """Batch-invariant mode runs f32_panel_linear on its packed weights where the CPU has AVX2 +
    FMA or AVX-512, and invariant_linear on the plain weights elsewhere: a trainer's recompute
    on either agrees bit for bit only if the two kernels sum in one order."""
    if not ext.f32_panel_supported():
        pytest.skip("this CPU has neither AVX2 + FMA nor AVX-512: no float32 panels to compare with")
    g = torch.Generator().manual_seed(M + K * N)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    panels = ext.f32_panel_linear(x, ext.f32_panel_pack(w), N, b)
    assert torch.equal(ext.invariant_linear(x, w, b), panels)
    assert torch.equal(panels, _invariant_linear_reference(x, w, b))


def test_invariant_linear_refuses_what_it_cannot_compute(ext):
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="float32 only"):
        ext.invariant_linear(x.bfloat16(), w.bfloat16())
    with pytest.raises(RuntimeError, match="K = 8"):
        ext.invariant_linear(x, torch.randn(3, 9))
    with pytest.raises(RuntimeError, match="bias"):
        ext.invariant_linear(x, w, torch.randn(4))
    assert ext.invariant_linear(x[:0], w).shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [49152, 1000, 7])
def test_logsumexp_rows_do_not_depend_on_the_batch(ext, dtype, V):
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(70, V, generator=g) * 4).to(dtype)
    full = ext.logsumexp_rows(x)
    torch.testing.assert_close(full, torch.logsumexp(x.float(), dim=-1), rtol=1e-6, atol=1e-5)
    for i, j in SLICES:
        assert torch.equal(ext.logsumexp_rows(x[i:j]), full[i:j]), (i, j)


def test_logsumexp_rows_special_values(ext):
    inf = float("inf")
    x = torch.tensor([[0.0, float("nan"), 1.0], [-inf, -inf, -inf], [inf, 0.0, 1.0], [-inf, 2.0, -inf]])
    got = ext.logsumexp_rows(x)
    assert got[0].isnan() and got[1] == -inf and got[2] == inf and got[3] == 2.0
