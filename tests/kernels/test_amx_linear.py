"""bf16_amx_linear (kernels/csrc/amx_linear.cpp), the bf16 matmul on AMX tiles, against float32
math rounded once to bf16: row counts that fill one tile, two, a block of 32 and a tail (the tile
shapes the kernel configures), N not a multiple of the 32-column panel, a bias, strided rows,
prefill-sized M (panel groups), and the same packed weight bf16_vnni_linear reads."""
import pytest
import torch


@pytest.fixture(scope="module")
def amx(ext):
    if not ext.bf16_amx_supported():
        pytest.skip("this CPU (or this process) has no AMX tiles")
    return ext


def reference(x, w, b=None):
    y = x.float() @ w.float().T
    return (y if b is None else y + b.float()).bfloat16()


@pytest.mark.parametrize("M", [1, 5, 16, 17, 31, 32, 33, 48, 64, 100])
@pytest.mark.parametrize("N,K", [(64, 32), (1728, 576), (45, 96), (3072, 1536)])
def test_matches_float32_math(amx, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    packed = amx.bf16_vnni_pack(w)
    for bias in (None, b):
        got, want = amx.bf16_amx_linear(x, packed, N, bias), reference(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (M, N)
        # float32 sums in another order, then one rounding to bf16: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3 * K ** 0.5)


def test_prefill_rows_span_panel_groups(amx):
    """Many rows and a wide weight: row blocks pass under groups of panels (and threads split the
    panels), every output still equal to one rounding of the float32 sums."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1030, 576, generator=g).bfloat16(), torch.randn(6000, 576, generator=g).bfloat16()
    got, want = amx.bf16_amx_linear(x, amx.bf16_vnni_pack(w), 6000), reference(x, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3 * 24)


def test_strided_rows_agree_with_the_vnni_kernel_and_bad_input_is_refused(amx):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).bfloat16()
    packed = amx.bf16_vnni_pack(w)
    wide = torch.randn(20, 100, generator=g).bfloat16()
    x = wide[:, 10:74]  # rows 100 apart
    got = amx.bf16_amx_linear(x, packed, 40)
    assert torch.equal(got, amx.bf16_amx_linear(x.contiguous(), packed, 40))
    torch.testing.assert_close(got.float(), amx.bf16_vnni_linear(x, packed, 40).float(), rtol=2 ** -7, atol=1e-2)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        amx.bf16_amx_linear(torch.randn(2, 62).bfloat16(), amx.bf16_vnni_pack(torch.randn(40, 62).bfloat16()), 40)
    with pytest.raises(RuntimeError, match="bf16_vnni_pack"):
        amx.bf16_amx_linear(torch.randn(2, 96).bfloat16(), packed, 40)  # K differs from the packed weight
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx.bf16_amx_linear(x.float(), packed, 40)
