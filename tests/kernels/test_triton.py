"""The Triton kernels against their torch references: in Triton's interpreter on CPU
(TRITON_INTERPRET=1, small shapes; triton is a dev extra) and, when a GPU is present, compiled
on it. Skipped when triton is not installed."""
import os

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_activation, triton_attention, triton_norm  # noqa: E402
from kernels.activation import silu_and_mul_ref  # noqa: E402
from kernels.attention import paged_decode_attention_ref  # noqa: E402
from kernels.norm import fused_add_rms_norm_ref  # noqa: E402

# tests/conftest.py sets TRITON_INTERPRET=1 on a machine without a GPU (CPU tensors); with one,
# the kernels compile for it
DEVICES = ["cuda"] if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("H", [64, 96])
def test_fused_add_rms_norm(device, dtype, with_residual, H):
    g = torch.Generator().manual_seed(H)
    x = torch.randn(5, H, generator=g).to(device, dtype)
    res = torch.randn(5, H, generator=g).to(device, dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(device, dtype)
    out, new_res = triton_norm.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    if dtype == torch.float32:
        assert torch.equal(new_res, ref_res)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    else:  # the interpreter rounds float32 -> bf16 toward zero (a GPU to nearest): each of the three
        # conversions (the sum, the normed value, the product) may cost a step; on a GPU one step
        # at most (the order of the sum of squares)
        steps = 1 if device == "cuda" else 4
        for got, want in ((new_res, ref_res), (out, ref_out)):
            assert ((got.float() - want.float()).abs() <= want.float().abs() * steps * 2 ** -7 + 1e-6).all()
        if device == "cuda":
            assert torch.equal(new_res, ref_res)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("I", [48, 1536])
def test_silu_and_mul(device, dtype, I):
    """I = 1536 (the default model's) spans two blocks of the kernel, 48 one partial block."""
    g = torch.Generator().manual_seed(I)
    gate_up = (3 * torch.randn(5, 2 * I, generator=g)).to(device, dtype)
    got, want = triton_activation.silu_and_mul(gate_up), silu_and_mul_ref(gate_up)
    assert got.shape == want.shape == (5, I) and got.dtype == dtype
    if dtype == torch.float32:  # Triton's exp is not libm's: a few ulps
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the interpreter rounds float32 -> bf16 toward zero (a GPU to nearest): a step for each of
        # the two roundings; on a GPU the exp's ulps may tip one rounding
        steps = 1 if device == "cuda" else 2
        assert ((got.float() - want.float()).abs() <= want.float().abs() * steps * 2 ** -7 + 1e-6).all()


def _paged_case(g, device, dtype, B=3, H=4, KVH=2, D=16, bs=4, num_blocks=24):
    k_cache = torch.randn(num_blocks, bs, KVH, D, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, bs, KVH, D, generator=g).to(device, dtype)
    lens = torch.tensor([1, 7, 18], dtype=torch.int32)[:B]
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:6] for _ in range(B)]).to(torch.int32)
    q = torch.randn(B, H, D, generator=g).to(device, dtype)
    return q, k_cache, v_cache, table.to(device), lens.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_n", [None, 4, 8], ids=["one-step", "a-block-a-step", "two-blocks-a-step"])
def test_paged_decode_attention(device, dtype, window, block_n):
    """Sequences of 1, 7 and 18 keys in blocks of 4: in one step (the default 64 keys), a block
    a step, two blocks a step (a window start and a sequence end inside a step)."""
    g = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, table, lens = _paged_case(g, device, dtype)
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, window, block_n)
    want = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, 0.25, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_paged_decode_attention_reads_a_layer_view_of_the_cache():
    """The engine passes one layer's K/V as views into the whole cache (non-default strides)."""
    g = torch.Generator().manual_seed(8)
    q, k_cache, v_cache, table, lens = _paged_case(g, DEVICES[0], torch.float32)
    whole = torch.stack([torch.stack([k_cache, v_cache])] * 2)  # (layers, 2, blocks, bs, KVH, D)
    k_view, v_view = whole[1, 0], whole[1, 1]
    got = triton_attention.paged_decode_attention(q, k_view, v_view, table, lens, 0.25)
    torch.testing.assert_close(got, paged_decode_attention_ref(q, k_cache, v_cache, table, lens, 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_rope_and_cache(dtype, qk_norm):
    from kernels import triton_rotary
    from kernels.rotary import rope_and_cache_ref, rope_cos_sin_cache, rope_inv_freq

    device = DEVICES[0]
    g = torch.Generator().manual_seed(9)
    T, Hq, Hkv, D, blocks, bs = 5, 4, 2, 16, 6, 4
    inv_freq, factor = rope_inv_freq(D, 10000.0, None)
    cs = rope_cos_sin_cache(inv_freq, factor, 64).to(device)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(device, dtype)
    positions = torch.tensor([0, 3, 17, 40, 63]).to(device)
    slots = torch.randperm(blocks * bs, generator=g)[:T].to(device)
    caches = [torch.zeros(blocks, bs, Hkv, D, dtype=dtype, device=device) for _ in range(4)]
    norms = [(1 + 0.2 * torch.randn(D, generator=g)).to(device, dtype) for _ in range(2)] if qk_norm else [None] * 2
    q, k = triton_rotary.rope_and_cache(qkv, positions, cs, caches[0], caches[1], slots, Hq, Hkv, D, *norms, 1e-6)
    q_ref, k_ref = rope_and_cache_ref(qkv, positions, cs, caches[2], caches[3], slots, Hq, Hkv, D, *norms, 1e-6)
    if dtype == torch.float32:  # (FMA contraction and the norm's sum order may differ in the last bit)
        tol = dict(rtol=1e-5, atol=1e-5) if qk_norm else dict(rtol=1e-6, atol=1e-6)
    else:  # the kernel computes in float32 and rounds once; the reference, as transformers does, rounds
        # cos and sin to bf16, then each product and sum (three roundings, five with the norm; the
        # interpreter also rounds toward zero). On an H200 the gap reached 0.0156 (a step at |x| ~ 2-4)
        tol = dict(rtol=(5 if qk_norm else 3) * 2 ** -7, atol=1e-2)
    for got, want in ((q, q_ref), (k, k_ref), (caches[0], caches[2])):
        torch.testing.assert_close(got, want, **tol)
    assert torch.equal(caches[1], caches[3])  # v: copied as is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy(dtype):
    from kernels import triton_sampling
    from kernels.sampling import greedy_ref

    device = DEVICES[0]
    g = torch.Generator().manual_seed(10)
    logits = (torch.randn(4, 5000, generator=g) * 3).to(device, dtype)
    logits[1, 4321] = logits[1, 77] = logits[1].max() + 1  # a tie across blocks: the first wins
    logits[2, :] = logits[2].min()
    logits[2, 4999] = logits[2, 4998] = 5.0  # a tie inside the last (partial) block
    ids, lps = triton_sampling.greedy(logits, True)
    ref_ids, ref_lps = greedy_ref(logits, True)
    assert torch.equal(ids, ref_ids) and ids[1] == 77 and ids[2] == 4998
    torch.testing.assert_close(lps, ref_lps, rtol=1e-5, atol=1e-5)
    assert triton_sampling.greedy(logits, False)[1] is None
