"""bf16_vnni_linear (kernels/csrc/vnni_linear.cpp), the bf16 matmul on AVX-512 BF16 CPUs, against
float32 math rounded once to bf16: every row count the register tiles split (1-8 and beyond), N
and K that are not multiples of the panel (32 columns) or the k pair, a bias, strided rows."""
import pytest
import torch


@pytest.fixture(scope="module")
def vnni(ext):
    if not ext.bf16_vnni_supported():
        pytest.skip("this CPU has no AVX-512 BF16")
    return ext


def reference(x, w, b=None):
    y = x.float() @ w.float().T
    return (y if b is None else y + b.float()).bfloat16()


@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("N,K", [(64, 32), (1728, 576), (45, 77), (17, 1)])
def test_matches_float32_math(vnni, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    packed = vnni.bf16_vnni_pack(w)
    assert tuple(packed.shape) == ((N + 31) // 32, (K + 1) // 2, 32, 2)
    for bias in (None, b):
        got, want = vnni.bf16_vnni_linear(x, packed, N, bias), reference(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (M, N)
        # float32 sums in another order, then one rounding to bf16: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3 * K ** 0.5)


def test_strided_rows_and_bad_input(vnni):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).bfloat16()
    packed = vnni.bf16_vnni_pack(w)
    wide = torch.randn(5, 100, generator=g).bfloat16()
    x = wide[:, 10:74]  # rows 100 apart
    assert torch.equal(vnni.bf16_vnni_linear(x, packed, 40), vnni.bf16_vnni_linear(x.contiguous(), packed, 40))
    with pytest.raises(RuntimeError, match="bf16_vnni_pack"):
        vnni.bf16_vnni_linear(torch.randn(2, 62).bfloat16(), packed, 40)  # K differs from the packed weight
    with pytest.raises(RuntimeError, match="bfloat16"):
        vnni.bf16_vnni_linear(x.float(), packed, 40)


@pytest.mark.parametrize("N,K", [(64, 32), (45, 77), (17, 1), (96, 130), (1728, 576)])
def test_pack_into_memory_it_packed_before(vnni, N, K):
    """The layout itself (panels of 32 columns, k in pairs, zeros past N and past an odd K), and a
    repack into an earlier packed tensor full of other values equals a fresh one."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    padded = torch.zeros((N + 31) // 32 * 32, (K + 1) // 2 * 2, dtype=torch.bfloat16)
    padded[:N, :K] = w
    want = padded.view(-1, 32, (K + 1) // 2, 2).permute(0, 2, 1, 3)
    fresh = vnni.bf16_vnni_pack(w)
    assert torch.equal(fresh, want)
    stale = torch.full_like(fresh, 7.0)
    assert vnni.bf16_vnni_pack(w, stale).data_ptr() == stale.data_ptr() and torch.equal(stale, want)
    with pytest.raises(RuntimeError, match="out must be"):
        vnni.bf16_vnni_pack(w, torch.empty(9, 1, 32, 2, dtype=torch.bfloat16))
