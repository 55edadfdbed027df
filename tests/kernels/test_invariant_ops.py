"""The batch-invariant C++ ops: a row's result must be the same bits whatever rows come with it
(alone, first, last, in a batch of any size), and close to the float64 / torch reference."""
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
