"""The int8 KV cache (kv_cache_dtype "int8", kernels/kv_quant.py): the C++ cache write stores
exactly the reference's codes and scales, and the C++ decode / prefill attention over int8 rows
match the float32 reference over the same (dequantized) rows."""
import math

import pytest
import torch

from kernels.attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from kernels.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows
from kernels.rotary import rope_and_cache, rope_and_cache_qk_ref, rope_and_cache_ref
from tests.kernels.test_fused_ops import gen_for, make_rope_inputs, randn
from tests.kernels.test_paged_attention import make_inputs
from tests.kernels.test_prefill_attention import ragged_step

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["f32", "bf16"]


def to_codes(cache: torch.Tensor) -> torch.Tensor:
    """A float cache view (num_blocks, block_size, KVH, D) as int8 rows, NaN rows kept NaN-free:
    a row the kernels must not read gets scale NaN, so reading it shows."""
    rows = quantize_rows(torch.nan_to_num(cache.float(), nan=1.0))
    nan_rows = cache.float().isnan().any(-1)
    rows[..., -SCALE_BYTES:][nan_rows] = torch.tensor([float("nan")]).view(torch.int8)
    return rows


def test_quantize_rows_round_trip_error_is_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 64, generator=gen) * torch.rand(500, 1, generator=gen) * 10
    x[3] = 0.0  # an all-zero row: scale 0, codes 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (500, 64 + SCALE_BYTES)
    scale = x.abs().amax(-1, keepdim=True) / 127
    back = dequantize_rows(rows)
    assert bool(((back - x).abs() <= scale * 0.5 * (1 + 1e-5) + 1e-12).all())
    assert torch.equal(back[3], torch.zeros(64)) and int(rows[:, :64].abs().max()) == 127
    # bf16 values quantize as their float32 values
    assert torch.equal(quantize_rows(x.bfloat16()), quantize_rows(x.bfloat16().float()))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128), (4, 4, 96)])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
def test_rope_and_cache_writes_the_reference_codes(ext, dtype, T, Hq, Hkv, D, qk_norm):
    """The op's q and k are the ones a float cache gets; its cache rows are quantize_rows of
    exactly that k and of v, and no other row changes."""
    gen = gen_for("rope_int8", T, Hq, D, qk_norm)
    qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, T, Hq, Hkv, D, dtype)
    norms = ()
    if qk_norm:
        norms = ((torch.rand(D, generator=gen) + 0.5).to(dtype), (torch.rand(D, generator=gen) + 0.5).to(dtype), 1e-6)
    codes = quantize_rows(kv)  # (2, 2, blocks, bs, Hkv, D + 4), garbage rows
    before = codes.clone()
    q, k = ext.rope_and_cache(qkv, positions, cos_sin, codes[1, 0], codes[1, 1], slots, Hq, Hkv, D, *norms)
    q_float, k_float = ext.rope_and_cache(qkv, positions, cos_sin, kv[1, 0], kv[1, 1], slots, Hq, Hkv, D, *norms)
    assert torch.equal(q, q_float) and torch.equal(k, k_float)
    v = qkv[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    flat = codes[1].reshape(2, -1, Hkv, D + SCALE_BYTES)
    assert torch.equal(flat[0, slots], quantize_rows(k))
    assert torch.equal(flat[1, slots], quantize_rows(v))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before[1].reshape(2, -1, Hkv, D + SCALE_BYTES)[:, untouched])
    assert torch.equal(codes[0], before[0])
    # the reference writes the same bytes, and the public entry point takes the op
    ref_codes = before.clone()
    q_ref, _ = rope_and_cache_ref(qkv, positions, cos_sin, ref_codes[1, 0], ref_codes[1, 1], slots, Hq, Hkv, D,
                                  *norms)
    torch.testing.assert_close(q_ref.float(), q.float(), rtol=1e-2 if dtype == torch.bfloat16 else 2e-6, atol=1e-5)
    public = before.clone()
    rope_and_cache(qkv, positions, cos_sin, public[1, 0], public[1, 1], slots, Hq, Hkv, D, *norms)
    assert torch.equal(public, codes)


def test_rope_and_cache_qk_writes_codes(ext):
    gen = gen_for("rope_qk_int8")
    T, Hq, Hkv, D = 33, 8, 2, 64
    qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, T, Hq, Hkv, D, torch.bfloat16)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = randn(gen, Hkv, T, D, dtype=torch.bfloat16).transpose(0, 1)  # strided views
    v = randn(gen, T, 2 * Hkv, D, dtype=torch.bfloat16)[:, ::2]
    codes, ref = quantize_rows(kv[0]), quantize_rows(kv[0])
    _, k_out = ext.rope_and_cache_qk(q, k, v, positions, cos_sin, codes[0], codes[1], slots)
    rope_and_cache_qk_ref(q, k, v, positions, cos_sin, ref[0], ref[1], slots)
    flat = codes.reshape(2, -1, Hkv, D + SCALE_BYTES)
    assert torch.equal(flat[0, slots], quantize_rows(k_out)) and torch.equal(flat[1, slots], quantize_rows(v))
    assert torch.equal(codes[1], ref[1])  # v needs no rotation: the reference's bytes exactly


def test_rope_and_cache_rejects_bad_int8_rows(ext):
    gen = gen_for("bad_int8")
    qkv, positions, slots, kv, cos_sin = make_rope_inputs(gen, 5, 4, 2, 64, torch.float32)
    wrong = torch.zeros(*kv.shape[2:-1], 64, dtype=torch.int8)  # no room for the scales
    with pytest.raises(RuntimeError, match="k_cache/v_cache must be contiguous"):
        ext.rope_and_cache(qkv, positions, cos_sin, wrong, wrong, slots, 4, 2, 64)
    q = randn(gen, 2, 4, 64)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head_dim codes and a 4-byte scale"):
        ext.paged_decode_attention(q, wrong, wrong, table, lens, 0.125, 0)


def check_close(out, ref, dtype):
    """The same float32 arithmetic on the same dequantized rows, in another order."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out.float()).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sliding_window", [None, 37], ids=lambda w: f"win{w}")
@pytest.mark.parametrize("B,num_heads,num_kv_heads,head_dim,block_size,max_len", [
    (1, 9, 3, 64, 16, 600),       # a lone sequence: (sequence, kv head) items
    (37, 9, 3, 64, 16, 600),      # whole sequences per item (the default model's shape)
    (37, 8, 2, 128, 32, 300),
    (12, 6, 2, 96, 16, 100),      # the generic head_dim path
    (9, 12, 2, 64, 16, 300),      # G = 6: the largest group kept in registers (AVX-512)
    (9, 14, 2, 64, 16, 300),      # G = 7: through memory
])
def test_decode_over_int8_rows(ext, dtype, sliding_window, B, num_heads, num_kv_heads, head_dim, block_size,
                               max_len):
    gen = torch.Generator().manual_seed(hash(("int8", B, head_dim)) % 2**31)
    q, k, v, table, lens = make_inputs(gen, B, num_heads, num_kv_heads, head_dim, block_size, max_len, dtype)
    k8, v8 = quantize_rows(k), quantize_rows(v)
    scale = 1 / math.sqrt(head_dim)
    ref = paged_decode_attention_ref(q, k8, v8, table, lens, scale, sliding_window)
    check_close(ext.paged_decode_attention(q, k8, v8, table, lens, scale, sliding_window or 0), ref, dtype)
    check_close(paged_decode_attention(q, k8, v8, table, lens, scale, sliding_window), ref, dtype)
    # what 8 bits cost against the float cache: a few hundredths for unit-variance rows
    exact = paged_decode_attention_ref(q, k, v, table, lens, scale, sliding_window).float()
    assert float((ref.float() - exact).abs().max()) < 0.05


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("step", ["fresh", "mixed"])
def test_prefill_over_int8_rows(ext, dtype, step):
    q_lens, contexts = {"fresh": ([128, 37], [0, 0]), "mixed": ([1, 70, 5, 16], [40, 0, 11, 16])}[step]
    gen = torch.Generator().manual_seed(hash(("int8 prefill", step)) % 2**31)
    q, k, v, table, cu, lens = ragged_step(gen, q_lens, contexts, 9, 3, 64, 16, dtype)
    k8, v8 = to_codes(k), to_codes(v)  # rows no sequence owns have NaN scales
    ref = paged_prefill_attention_ref(q, k8, v8, table, cu, lens, 0.125, None)
    check_close(ext.paged_prefill_attention(q, k8, v8, table, cu, lens, 0.125, 0), ref, dtype)
    check_close(paged_prefill_attention(q, k8, v8, table, cu, lens, 0.125, None), ref, dtype)
    check_close(ext.paged_prefill_attention(q, k8, v8, table, cu, lens, 0.125, 20),
                paged_prefill_attention_ref(q, k8, v8, table, cu, lens, 0.125, 20), dtype)
