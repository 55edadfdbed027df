"""The fused C++ CPU ops (kernels/csrc/fused_ops.cpp) against their torch references, and the
references against Hugging Face's Llama code.

Tolerances: float32 results must agree to ~1e-6 relative; bfloat16 results to at most one bf16
ulp on at most 0.1% of the elements (a float32 summation order different from ATen's would cause
such rare flips). On an AVX-512 torch build the ops are in fact bit-identical to the references
(they follow ATen's summation order and SLEEF's exp), and on its AVX2 build too, which
test_bit_identical_to_aten pins.
"""
import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import (
    apply_rope,
    rope_and_cache,
    rope_and_cache_qk,
    rope_and_cache_qk_ref,
    rope_and_cache_ref,
    rope_cos_sin_cache,
    rope_inv_freq,
)

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["f32", "bf16"]
TOKENS = [1, 7, 32, 300]
# ATen's CPU kernels on this machine: their AVX-512 and AVX2 builds are what the ops follow bit for bit
ATEN_SIMD = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")


def gen_for(*key):
    return torch.Generator().manual_seed(hash(key) % 2**31)


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def check(out, ref):
    """out matches ref: f32 to ~1e-6, bf16 within 1 ulp on <= 0.1% of the elements."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
        return
    same = out == ref
    bits = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert bool((same | (bits <= 1)).all()), f"max diff {(out.float() - ref.float()).abs().max()}"
    frac = 1.0 - same.float().mean().item()
    assert frac <= 1e-3, f"{frac:.2%} of the elements differ by one ulp"


# ---- RMSNorm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H", [576, 64, 192, 1024, 2048, 100])
def test_fused_add_rms_norm(ext, dtype, T, H):
    gen = gen_for("addnorm", T, H)
    # x is a row-strided view (a slice of wider rows); residual contiguous.
    x = randn(gen, T, H + 24, dtype=dtype, scale=3.0)[:, 8: 8 + H]
    res = randn(gen, T, H, dtype=dtype)
    w = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    for eps in (1e-6, 1e-5):
        out, new_res = ext.fused_add_rms_norm(x, res, w, eps)
        ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, eps)
        assert torch.equal(new_res, ref_res)  # one rounding of the float32 sum, both sides
        check(out, ref_out)
        # no residual: normalize x, hand x back as the residual
        out, new_res = ext.fused_add_rms_norm(x, None, w, eps)
        assert new_res is x or torch.equal(new_res, x)
        check(out, rms_norm_ref(x, w, eps))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", TOKENS)
def test_rms_norm_2d_and_per_head_views(ext, dtype, T):
    gen = gen_for("norm", T)
    H, Hq, Hkv, D = 576, 9, 3, 64
    x = randn(gen, T, H, dtype=dtype, scale=2.0)
    w = randn(gen, H, dtype=dtype)
    check(ext.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    check(ext.rms_norm(x[0], w, 1e-6), rms_norm_ref(x[0], w, 1e-6))  # 1-d
    # Qwen3's q/k norms: per head over strided (T, heads, D) views of a qkv row
    for D in (64, 128):
        qkv = randn(gen, T, (Hq + 2 * Hkv) * D, dtype=dtype)
        q = qkv[:, : Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D)
        wq, wk = randn(gen, D, dtype=dtype), randn(gen, D, dtype=dtype)
        for view, wv in ((q, wq), (k, wk), (q.transpose(0, 1), wq)):
            out = ext.rms_norm(view, wv, 1e-6)
            assert out.is_contiguous()
            check(out, rms_norm_ref(view, wv, 1e-6))


# ---- SiLU and multiply --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("I", [1536, 64, 100, 33])  # 100, 33: rows with a scalar tail
def test_silu_and_mul(ext, dtype, T, I):
    gen = gen_for("silu", T, I)
    gate_up = randn(gen, T, 2 * I, dtype=dtype, scale=4.0)
    out = ext.silu_and_mul(gate_up)
    assert out.shape == (T, I) and out.is_contiguous()
    check(out, silu_and_mul_ref(gate_up))
    strided = randn(gen, T, 2 * I + 16, dtype=dtype, scale=4.0)[:, 16:]
    check(ext.silu_and_mul(strided), silu_and_mul_ref(strided))


def test_silu_special_values(ext):
    vals = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, 89.0, -88.0, -89.0, -104.0, -105.0, 100.0,
                         1e30, -1e30, float("inf"), float("-inf"), float("nan")] * 4)
    for dtype in DTYPES:
        gate_up = torch.stack([vals, torch.ones_like(vals)]).reshape(1, -1).to(dtype)
        out, ref = ext.silu_and_mul(gate_up), silu_and_mul_ref(gate_up)
        assert torch.equal(out.isnan(), ref.isnan())
        finite = ~ref.isnan()
        assert torch.equal(out[finite], ref[finite]), (out, ref)


# ---- RoPE + KV cache ----------------------------------------------------------------------------

SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 96), (2, 1, 40)]  # 40: half a head is not 16-aligned


def make_rope_inputs(gen, T, Hq, Hkv, D, dtype, num_blocks=64, block_size=16):
    qkv = randn(gen, T, (Hq + 2 * Hkv) * D + 8, dtype=dtype)[:, 8:]  # row-strided view
    positions = torch.randint(0, 4096, (T,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]  # distinct, scattered
    # the caches are views kv[layer, 0 / 1], garbage everywhere
    kv = randn(gen, 2, 2, num_blocks, block_size, Hkv, D, dtype=dtype, scale=5.0)
    cos_sin = rope_cos_sin_cache(*rope_inv_freq(D, 10000.0, None), 4096)
    return qkv, positions, slots, kv, cos_sin


def check_caches(kv_out, kv_ref, kv_before, slots, Hkv, D):
    """Written slots hold the reference's values exactly; all other slots are unchanged."""
    flat_out = kv_out.reshape(2, 2, -1, Hkv, D)
    flat_ref = kv_ref.reshape(2, 2, -1, Hkv, D)
    flat_before = kv_before.reshape(2, 2, -1, Hkv, D)
    untouched = torch.ones(flat_out.shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_out[:, :, untouched], flat_before[:, :, untouched])
    assert torch.equal(flat_out[:, :, slots], flat_ref[:, :, slots])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hq,Hkv,D", SHAPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
def test_rope_and_cache(ext, dtype, T, Hq, Hkv, D, qk_norm):
    gen = gen_for("rope", T, Hq, D, qk_norm)
    qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, T, Hq, Hkv, D, dtype)
    norms = ()
    if qk_norm:
        norms = ((torch.rand(D, generator=gen) + 0.5).to(dtype),
                 (torch.rand(D, generator=gen) + 0.5).to(dtype), 1e-6)
    kv_before, kv_ref = kv.clone(), kv.clone()
    q, k = ext.rope_and_cache(qkv, positions, cos_sin, kv[1, 0], kv[1, 1], slots, Hq, Hkv, D, *norms)
    q_ref, k_ref = rope_and_cache_ref(qkv, positions, cos_sin, kv_ref[1, 0], kv_ref[1, 1], slots,
                                      Hq, Hkv, D, *norms)
    assert q.shape == (T, Hq, D) and k.shape == (T, Hkv, D) and q.is_contiguous() and k.is_contiguous()
    check(q, q_ref)
    check(k, k_ref)
    if torch.equal(k, k_ref):
        check_caches(kv, kv_ref, kv_before, slots, Hkv, D)
    else:  # an ulp flip in k also shows in the cache: compare loosely, layout exactly
        check(kv, kv_ref)
        check_caches(kv, kv, kv_before, slots, Hkv, D)
    # v is stored unrotated, bit for bit
    v = qkv[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    assert torch.equal(kv[1, 1].reshape(-1, Hkv, D)[slots], v)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hq,Hkv,D", SHAPES[:3])
def test_rope_and_cache_qk_strided_views(ext, dtype, T, Hq, Hkv, D):
    gen = gen_for("rope_qk", T, Hq, D)
    qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, T, Hq, Hkv, D, dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)  # row-strided
    k = randn(gen, Hkv, T, D, dtype=dtype).transpose(0, 1)  # head-major: strides (D, T*D, 1)
    v = randn(gen, T, 2 * Hkv, D, dtype=dtype)[:, ::2]  # every other head
    kv_before, kv_ref = kv.clone(), kv.clone()
    q_out, k_out = ext.rope_and_cache_qk(q, k, v, positions, cos_sin, kv[0, 0], kv[0, 1], slots)
    q_ref, k_ref = rope_and_cache_qk_ref(q, k, v, positions, cos_sin, kv_ref[0, 0], kv_ref[0, 1], slots)
    check(q_out, q_ref)
    check(k_out, k_ref)
    check(kv, kv_ref)
    check_caches(kv, kv, kv_before, slots, Hkv, D)
    assert torch.equal(kv[0, 1].reshape(-1, Hkv, D)[slots], v)


def test_rope_and_cache_rejects_bad_slots_and_positions(ext):
    gen = gen_for("bad")
    qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, 5, 4, 2, 64, torch.float32)
    before = kv.clone()
    n_slots = kv.shape[2] * kv.shape[3]
    for bad_slots, bad_pos in ((slots.clone().fill_(n_slots), positions), (slots.clone().fill_(-1), positions),
                               (slots, positions.clone().fill_(4096))):
        with pytest.raises(RuntimeError, match="out of range"):
            ext.rope_and_cache(qkv, bad_pos, cos_sin, kv[0, 0], kv[0, 1], bad_slots, 4, 2, 64)
    assert torch.equal(kv, before)  # checked before anything is written


# ---- exactness, threading, dispatchers ----------------------------------------------------------

@pytest.mark.skipif(not ATEN_SIMD, reason="bit-exactness is pinned for ATen's AVX-512 and AVX2 kernels only")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bit_identical_to_aten(ext, dtype):
    """Row lengths that leave tails: ATen's vector loops take 2 vectors a step (16 floats on AVX2,
    32 on AVX-512) and leave the rest to a scalar loop, which the op must mirror."""
    gen = gen_for("exact", str(dtype))
    for T in (1, 32, 300):
        for H in (576, 100, 2056):
            x, res = randn(gen, T, H, dtype=dtype, scale=3.0), randn(gen, T, H, dtype=dtype)
            w = randn(gen, H, dtype=dtype)
            out, new_res = ext.fused_add_rms_norm(x, res, w, 1e-5)
            ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
            assert torch.equal(out, ref_out) and torch.equal(new_res, ref_res), H
            assert torch.equal(ext.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)), H
        for I in (1536, 17, 40, 48, 100):
            gate_up = randn(gen, T, 2 * I, dtype=dtype, scale=4.0)
            assert torch.equal(ext.silu_and_mul(gate_up), silu_and_mul_ref(gate_up)), I
        qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, T, 9, 3, 64, dtype)
        kv_ref = kv.clone()
        q, k = ext.rope_and_cache(qkv, positions, cos_sin, kv[0, 0], kv[0, 1], slots, 9, 3, 64)
        q_ref, k_ref = rope_and_cache_ref(qkv, positions, cos_sin, kv_ref[0, 0], kv_ref[0, 1], slots, 9, 3, 64)
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(kv, kv_ref)


def test_threads_do_not_change_results(ext):
    """Large calls split rows over threads; every row is computed the same way either way."""
    gen = gen_for("threads")
    x, res, w = randn(gen, 512, 2048), randn(gen, 512, 2048), randn(gen, 2048)
    gate_up = randn(gen, 512, 2 * 1536, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((*ext.fused_add_rms_norm(x, res, w, 1e-6), ext.silu_and_mul(gate_up)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_dispatchers_use_the_extension_on_cpu(ext):
    gen = gen_for("dispatch")
    for dtype in DTYPES:
        x, res, w = randn(gen, 7, 576, dtype=dtype), randn(gen, 7, 576, dtype=dtype), randn(gen, 576, dtype=dtype)
        for a, b in zip(fused_add_rms_norm(x, res, w, 1e-6), ext.fused_add_rms_norm(x, res, w, 1e-6)):
            assert torch.equal(a, b)
        assert torch.equal(rms_norm(x, w, 1e-6), ext.rms_norm(x, w, 1e-6))
        gate_up = randn(gen, 7, 256, dtype=dtype)
        assert torch.equal(silu_and_mul(gate_up), ext.silu_and_mul(gate_up))
        qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, 7, 9, 3, 64, dtype)
        kv2 = kv.clone()
        a = rope_and_cache(qkv, positions.int(), cos_sin, kv[0, 0], kv[0, 1], slots, 9, 3, 64)  # int32 ok
        b = ext.rope_and_cache(qkv, positions, cos_sin, kv2[0, 0], kv2[0, 1], slots, 9, 3, 64)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(kv, kv2)
        q, k, v = (qkv[:, :576].view(7, 9, 64), qkv[:, 576:768].view(7, 3, 64), qkv[:, 768:].view(7, 3, 64))
        a = rope_and_cache_qk(q, k, v, positions, cos_sin, kv[1, 0], kv[1, 1], slots)
        b = ext.rope_and_cache_qk(q, k, v, positions, cos_sin, kv2[1, 0], kv2[1, 1], slots)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(kv, kv2)


def test_dispatchers_fall_back_for_unsupported_inputs():
    """float64 (no C++ op) and a weight of another dtype go to the reference."""
    gen = gen_for("fallback")
    x, res, w = randn(gen, 3, 64, dtype=torch.float64), randn(gen, 3, 64, dtype=torch.float64), randn(gen, 64)
    for a, b in zip(fused_add_rms_norm(x, res, w, 1e-6), fused_add_rms_norm_ref(x, res, w, 1e-6)):
        assert torch.equal(a, b)
    xb = x.bfloat16()
    assert torch.equal(rms_norm(xb, w, 1e-6), rms_norm_ref(xb, w, 1e-6))  # f32 weight: promotes
    gate_up = randn(gen, 3, 64, dtype=torch.float64)
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_references_run_on_cuda():
    gen = gen_for("cuda")
    qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, 7, 9, 3, 64, torch.bfloat16)
    kv_cpu = kv.clone()
    dev = [t.cuda() for t in (qkv, positions, slots, kv, cos_sin)]
    q, _ = rope_and_cache(dev[0], dev[1], dev[4], dev[3][0, 0], dev[3][0, 1], dev[2], 9, 3, 64)
    q_ref, _ = rope_and_cache_ref(qkv, positions, cos_sin, kv_cpu[0, 0], kv_cpu[0, 1], slots, 9, 3, 64)
    torch.testing.assert_close(q.cpu(), q_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dev[3].cpu(), kv_cpu, rtol=1e-2, atol=1e-2)
    x = dev[0][:, :576]
    w = torch.ones(576, dtype=torch.bfloat16, device="cuda")
    assert fused_add_rms_norm(x, x, w, 1e-6)[0].device.type == "cuda"
    assert silu_and_mul(dev[0]).device.type == "cuda"


# ---- the references against Hugging Face -------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_norm_references_match_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = gen_for("hf_norm")
    H = 576
    hf = LlamaRMSNorm(H, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(randn(gen, H))
    x, res = randn(gen, 32, H, dtype=dtype, scale=3.0), randn(gen, 32, H, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, hf.weight, 1e-5), hf(x))
        out, new_res = fused_add_rms_norm_ref(x, res, hf.weight, 1e-5)
        assert torch.equal(new_res, res + x) and torch.equal(out, hf(res + x))
        # per head, over a strided view (Qwen3's q_norm)
        hf_d = LlamaRMSNorm(64, eps=1e-6).to(dtype)
        hf_d.weight.copy_(randn(gen, 64))
        view = x[:, :576].view(32, 9, 64)
        assert torch.equal(rms_norm_ref(view, hf_d.weight, 1e-6), hf_d(view))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_reference_matches_hf(dtype):
    from transformers.activations import ACT2FN

    gen = gen_for("hf_silu")
    I = 1536
    gate_up = randn(gen, 32, 2 * I, dtype=dtype, scale=4.0)
    act = ACT2FN["silu"]
    assert torch.equal(silu_and_mul_ref(gate_up), act(gate_up[:, :I]) * gate_up[:, I:])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_reference_matches_hf(dtype):
    """rope_and_cache_ref's q and k against apply_rotary_pos_emb fed the same cos/sin rows (HF's
    own rotary embedding agrees with our cache to ~1e-6, see test_rotary.py), cast to the dtype."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = gen_for("hf_rope")
    T, Hq, Hkv, D = 37, 9, 3, 64
    qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, T, Hq, Hkv, D, dtype)
    q_ref, k_ref = rope_and_cache_ref(qkv, positions, cos_sin, kv[0, 0], kv[0, 1], slots, Hq, Hkv, D)
    cs = cos_sin[positions]  # (T, 2, D/2) float32
    cos = torch.cat([cs[:, 0], cs[:, 0]], dim=-1)[None].to(dtype)  # HF: (1, T, D) in x's dtype
    sin = torch.cat([cs[:, 1], cs[:, 1]], dim=-1)[None].to(dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D).transpose(0, 1)[None]  # HF layout (1, H, T, D)
    k = qkv[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D).transpose(0, 1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(q_ref, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ref, k_hf[0].transpose(0, 1))
    # and the cache holds exactly the rotated k and the raw v
    assert torch.equal(kv[0, 0].reshape(-1, Hkv, D)[slots], k_ref)
    assert torch.equal(kv[0, 1].reshape(-1, Hkv, D)[slots], qkv[:, (Hq + Hkv) * D:].reshape(T, Hkv, D))
    # apply_rope (kernels/rotary.py) is the building block: same result on the same inputs
    assert torch.equal(apply_rope(qkv[:, : Hq * D].view(T, Hq, D), cos[0, :, None, : D // 2],
                                  sin[0, :, None, : D // 2]), q_ref)
