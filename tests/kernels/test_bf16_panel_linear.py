"""bf16_panel_linear (kernels/csrc/f32_linear.cpp), the bf16 matmul on CPUs with AVX-512 or AVX2 but
no AVX-512 BF16: float32 FMA chains over bf16 weights widened in registers, rounded to bf16 once.
Against float64 math rounded to bf16 (the one rounding it should differ from it by, at most one
bf16 step where a float32 sum lands near a rounding boundary): every row count the register tiles
split, N and K off the panel (32 columns) and the 8 x 8 pack transposes, a bias, strided rows; the
packed columns (pairs of a vector's lanes, so one load widens into two vectors) and a repack into
memory it packed before; and the float32 panels' batch invariance, which the same tiles give."""
import pytest
import torch


@pytest.fixture(scope="module")
def panels(ext):
    if not ext.f32_panel_supported():
        pytest.skip("this CPU has neither AVX-512 nor AVX2 + FMA")
    return ext


def rand(*shape, g):
    return torch.randn(*shape, generator=g).bfloat16()


@pytest.mark.parametrize("M", [1, 2, 3, 4, 6, 7, 12, 13, 40, 300])
@pytest.mark.parametrize("N,K", [(64, 32), (1728, 576), (45, 77), (17, 1), (96, 1536), (40, 9)])
def test_matches_float64_math_rounded_once(panels, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w, b = rand(M, K, g=g), rand(N, K, g=g), rand(N, g=g)
    packed = panels.bf16_panel_pack(w)
    assert packed.dtype == torch.bfloat16 and tuple(packed.shape) == ((N + 31) // 32, K, 32)
    for bias in (None, b):
        got = panels.bf16_panel_linear(x, packed, N, bias)
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (M, N)
        want = exact.bfloat16()
        # float32 sums of exact bf16 products: off the float64 sum by a few float32 roundings, so
        # at most one bf16 step from its rounding, and equal to it almost everywhere
        step = (want.double().abs() * 2.0 ** -7).clamp_min(2.0 ** -126) + 1e-6 * K ** 0.5
        assert ((got.double() - want.double()).abs() <= step).all()
        assert (got == want).double().mean() > 0.99


def test_rows_give_the_same_bits_in_any_batch(panels):
    g = torch.Generator().manual_seed(3)
    x, w = rand(37, 576, g=g), rand(200, 576, g=g)
    packed = panels.bf16_panel_pack(w)
    whole = panels.bf16_panel_linear(x, packed, 200)
    for lo, hi in ((0, 1), (5, 17), (12, 37), (36, 37)):
        assert torch.equal(panels.bf16_panel_linear(x[lo:hi], packed, 200), whole[lo:hi])


def test_equals_the_float32_panels_rounded(panels):
    """The same FMA chains as f32_panel_linear on the widened weights: its float32 result rounded."""
    g = torch.Generator().manual_seed(5)
    x, w, b = rand(9, 200, g=g), rand(70, 200, g=g), rand(70, g=g)
    want = panels.f32_panel_linear(x.float(), panels.f32_panel_pack(w.float()), 70, b.float()).bfloat16()
    assert torch.equal(panels.bf16_panel_linear(x, panels.bf16_panel_pack(w), 70, b), want)


def test_strided_rows_and_bad_input(panels):
    g = torch.Generator().manual_seed(0)
    w = rand(40, 64, g=g)
    packed = panels.bf16_panel_pack(w)
    x = rand(5, 100, g=g)[:, 10:74]  # rows 100 apart
    assert torch.equal(panels.bf16_panel_linear(x, packed, 40), panels.bf16_panel_linear(x.contiguous(), packed, 40))
    with pytest.raises(RuntimeError, match="bf16_panel_pack"):
        panels.bf16_panel_linear(rand(2, 62, g=g), packed, 40)  # K differs from the packed weight
    with pytest.raises(RuntimeError, match="bfloat16"):
        panels.bf16_panel_linear(x.float(), packed, 40)
    with pytest.raises(RuntimeError, match="bias"):
        panels.bf16_panel_linear(x, packed, 40, torch.zeros(40))
    with pytest.raises(RuntimeError, match="bfloat16"):
        panels.bf16_panel_pack(w.float())


@pytest.mark.parametrize("N,K", [(64, 32), (45, 77), (17, 1), (96, 130), (1728, 576)])
def test_pack_into_memory_it_packed_before(panels, N, K):
    """The layout: panels of 32 columns, k-major, zeros past N, and within a k step each group of
    2L columns (L = 16 lanes with AVX-512, 8 with AVX2) stored as pairs (c, c + L); a repack into an
    earlier packed tensor full of other values equals a fresh one."""
    g = torch.Generator().manual_seed(N + K)
    w = rand(N, K, g=g)
    padded = torch.zeros((N + 31) // 32 * 32, K, dtype=torch.bfloat16)
    padded[:N] = w
    fresh = panels.bf16_panel_pack(w)
    plain = padded.view(-1, 32, K).permute(0, 2, 1)  # (panels, K, 32 columns in order)
    lanes = [L for L in (16, 8) if torch.equal(fresh, _pairs(plain, L))]
    assert lanes, "the packed columns are neither AVX-512's nor AVX2's pairs"
    stale = torch.full_like(fresh, 7.0)
    assert panels.bf16_panel_pack(w, stale).data_ptr() == stale.data_ptr() and torch.equal(stale, fresh)
    with pytest.raises(RuntimeError, match="out must be"):
        panels.bf16_panel_pack(w, torch.empty(9, 1, 32, dtype=torch.bfloat16))


def _pairs(plain: torch.Tensor, lanes: int) -> torch.Tensor:
    """Columns c and c + lanes side by side, in each group of 2 * lanes."""
    groups = plain.reshape(*plain.shape[:2], 32 // (2 * lanes), 2, lanes)
    return groups.transpose(-1, -2).reshape(plain.shape)


def test_auto_dtype_serves_bf16_where_bf16_is_fast(ext, tmp_path, monkeypatch):
    """dtype "auto" on a CPU: bf16 with native bf16 matmuls or these panels (AVX2 + FMA / AVX-512,
    kernels built), float32 where neither runs (torch's own bf16 matmul on AVX2 is 5-8x slower than
    its float32 one) and in batch-invariant mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.config import EngineConfig
    from kernels import cpu_ext

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    native = cpu_ext.cpu_has("amx_bf16") or cpu_ext.cpu_has("avx512_bf16")
    panels = ext is not None and ext.f32_panel_supported()
    assert panels == (cpu_ext.cpu_has("avx512f") or (cpu_ext.cpu_has("avx2") and cpu_ext.cpu_has("fma")))
    auto = EngineConfig(model=str(tmp_path), device="cpu")
    assert auto.dtype == ("bfloat16" if native or panels else "float32")
    assert EngineConfig(model=str(tmp_path), device="cpu", batch_invariant=True).dtype == "float32"
    monkeypatch.setattr(cpu_ext, "load", lambda: None)  # no compiler: the panels are missing
    want = "bfloat16" if native else "float32"
    assert EngineConfig(model=str(tmp_path), device="cpu").dtype == want
