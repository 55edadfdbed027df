"""f32_panel_linear (kernels/csrc/f32_linear.cpp), the float32 matmul on CPUs with AVX-512 or AVX2, against
float64 math: every row count the register tiles split (1-12 and beyond, prefill-sized), N and
K that are not multiples of the panel (32 columns) or the transposed 16 x 16 blocks, a bias,
strided rows; the packed layout itself and a repack into memory it packed before; and the
batch invariance that one FMA chain per output gives."""
import pytest
import torch


@pytest.fixture(scope="module")
def f32(ext):
    if not ext.f32_panel_supported():
        pytest.skip("this CPU has neither AVX-512 nor AVX2 + FMA")
    return ext


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 12, 13, 24, 40, 300])
@pytest.mark.parametrize("N,K", [(64, 32), (1728, 576), (45, 77), (17, 1), (96, 1536)])
def test_matches_float64_math(f32, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    packed = f32.f32_panel_pack(w)
    assert tuple(packed.shape) == ((N + 31) // 32, K, 32)
    for bias in (None, b):
        got = f32.f32_panel_linear(x, packed, N, bias)
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        assert got.dtype == torch.float32 and got.shape == (M, N)
        # float32 FMAs in k order: within a few float32 roundings of each product's size
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * K ** 0.5 * 4)


def test_rows_give_the_same_bits_in_any_batch(f32):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 576, generator=g), torch.randn(200, 576, generator=g)
    packed = f32.f32_panel_pack(w)
    whole = f32.f32_panel_linear(x, packed, 200)
    for lo, hi in ((0, 1), (5, 17), (12, 37), (36, 37)):
        assert torch.equal(f32.f32_panel_linear(x[lo:hi], packed, 200), whole[lo:hi])


def test_strided_rows_and_bad_input(f32):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g)
    packed = f32.f32_panel_pack(w)
    x = torch.randn(5, 100, generator=g)[:, 10:74]  # rows 100 apart
    assert torch.equal(f32.f32_panel_linear(x, packed, 40), f32.f32_panel_linear(x.contiguous(), packed, 40))
    with pytest.raises(RuntimeError, match="f32_panel_pack"):
        f32.f32_panel_linear(torch.randn(2, 62), packed, 40)  # K differs from the packed weight
    with pytest.raises(RuntimeError, match="float32"):
        f32.f32_panel_linear(x.bfloat16(), packed, 40)


@pytest.mark.parametrize("N,K", [(64, 32), (45, 77), (17, 1), (96, 130), (1728, 576)])
def test_pack_into_memory_it_packed_before(f32, N, K):
    """The layout itself (panels of 32 columns, k-major, zeros past N), and a repack into an
    earlier packed tensor full of other values equals a fresh one."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g)
    padded = torch.zeros((N + 31) // 32 * 32, K)
    padded[:N] = w
    want = padded.view(-1, 32, K).permute(0, 2, 1)
    fresh = f32.f32_panel_pack(w)
    assert torch.equal(fresh, want)
    stale = torch.full_like(fresh, 7.0)
    assert f32.f32_panel_pack(w, stale).data_ptr() == stale.data_ptr() and torch.equal(stale, want)
    with pytest.raises(RuntimeError, match="out must be"):
        f32.f32_panel_pack(w, torch.empty(9, 1, 32))
