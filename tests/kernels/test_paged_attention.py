"""The C++ CPU paged decode attention op against the pure-torch reference."""
import math

import pytest
import torch

from kernels.attention import paged_decode_attention, paged_decode_attention_ref


def make_inputs(gen, B, num_heads, num_kv_heads, head_dim, block_size, max_len, dtype,
                layers=2, fixed_len=None):
    """Random q / KV cache; each sequence's blocks are scattered at random over the cache."""
    lens = torch.randint(1, max_len + 1, (B,), generator=gen, dtype=torch.int32)
    if fixed_len is not None:
        lens.fill_(fixed_len)
    max_blocks = (max_len + block_size - 1) // block_size + 2  # spare garbage columns
    num_blocks = B * max_blocks + 3
    # kv[layer, 0 / 1] views, like the engine's cache (contiguous in their own shape).
    kv = torch.randn(layers, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv = kv.to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)[:B * max_blocks].reshape(B, max_blocks)
    table = perm.to(torch.int32)
    # Entries past each sequence's end are garbage, including out-of-range block ids.
    used = (lens.long() + block_size - 1) // block_size
    garbage = torch.arange(max_blocks)[None, :] >= used[:, None]
    table[garbage] = torch.randint(-(10**6), 10**6, (int(garbage.sum()),), generator=gen,
                                   dtype=torch.int32)
    q = torch.randn(B, num_heads, head_dim, generator=gen).to(dtype)
    layer = int(torch.randint(layers, (1,), generator=gen))
    return q, kv[layer, 0], kv[layer, 1], table, lens


def check_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # both round a float32 result to bf16: at most ~1 bf16 ulp apart
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 1, 37, 200], ids=lambda w: f"win{w}")
@pytest.mark.parametrize("B,num_heads,num_kv_heads,head_dim,block_size,max_len", [
    (1, 4, 4, 64, 16, 1),          # a single token, MHA
    (1, 9, 3, 64, 16, 600),        # GQA 3 (the default model's shape)
    (37, 9, 3, 64, 16, 600),
    (37, 8, 2, 128, 32, 600),      # GQA 4
    (37, 12, 12, 128, 16, 300),    # MHA, head_dim 128
    (5, 6, 2, 64, 32, 33),         # short sequences, lengths near block edges
    (3, 4, 1, 96, 16, 100),        # generic head_dim path (not 64 / 128)
    (12, 6, 2, 96, 16, 100),       # generic head_dim, several kv heads per work item
    # With AVX-512 a kv head's G query rows and accumulators stay in registers up to G = 6 at
    # head_dim 64 and G = 2 at 128; a larger G takes the loops through memory.
    (9, 12, 2, 64, 16, 300),       # G = 6 in registers
    (9, 14, 2, 64, 16, 300),       # G = 7 through memory
    (9, 4, 2, 128, 16, 300),       # head_dim 128, G = 2 in registers
])
def test_matches_reference(ext, dtype, sliding_window, B, num_heads, num_kv_heads, head_dim,
                           block_size, max_len):
    gen = torch.Generator().manual_seed(hash((B, num_heads, head_dim, max_len)) % 2**31)
    q, k, v, table, lens = make_inputs(gen, B, num_heads, num_kv_heads, head_dim, block_size,
                                       max_len, dtype)
    scale = 1 / math.sqrt(head_dim)
    ref = paged_decode_attention_ref(q, k, v, table, lens, scale, sliding_window)
    out = ext.paged_decode_attention(q, k, v, table, lens, scale, sliding_window or 0)
    check_close(out, ref, dtype)
    # The public entry point routes CPU tensors to the same op.
    check_close(paged_decode_attention(q, k, v, table, lens, scale, sliding_window), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_each_sequence_same_alone_as_in_a_batch(ext, dtype):
    """A big batch runs whole sequences as work items and a lone sequence runs (sequence, kv head)
    items, on a different number of threads: every head's output must still be bit-identical
    (batch-invariant mode relies on it)."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, table, lens = make_inputs(gen, 37, 9, 3, 64, 16, 300, dtype)
    batch = ext.paged_decode_attention(q, k, v, table, lens, 0.125, 0)
    for b in (0, 11, 36):
        alone = ext.paged_decode_attention(q[b:b + 1], k, v, table[b:b + 1], lens[b:b + 1], 0.125, 0)
        assert torch.equal(alone, batch[b:b + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_heads", [3, 1], ids=["gqa3", "mqa"])
def test_long_windows_in_parts(ext, dtype, kv_heads):
    """A window longer than the kernel's part (512 tokens) is done in parts spread over the
    threads and combined: close to a float64 reference, and bit-identical whatever the batch and
    the thread count (the parts follow the window alone; batch-invariant mode relies on it)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, table, lens = make_inputs(gen, 6, 3 * kv_heads, kv_heads, 64, 16, 2100, dtype, fixed_len=2100)
    lens[:] = torch.tensor([512, 513, 1024 + 17, 2100, 40, 1600], dtype=torch.int32)  # part edges
    for window in (None, 700, 1500):
        ref = paged_decode_attention_ref(q.double(), k.double(), v.double(), table, lens, 0.125, window)
        batch = ext.paged_decode_attention(q, k, v, table, lens, 0.125, window or 0)
        check_close(batch, ref.to(dtype), dtype)
        threads = torch.get_num_threads()
        try:
            for n in sorted({1, 2, threads}):
                torch.set_num_threads(n)
                for b in range(6):
                    alone = ext.paged_decode_attention(q[b:b + 1], k, v, table[b:b + 1], lens[b:b + 1], 0.125,
                                                       window or 0)
                    assert torch.equal(alone, batch[b:b + 1]), (n, b, window)
        finally:
            torch.set_num_threads(threads)


def test_window_larger_than_sequence_and_block_edges(ext):
    gen = torch.Generator().manual_seed(1)
    for seq_len in (1, 15, 16, 17, 31, 32, 33, 64):
        q, k, v, table, lens = make_inputs(gen, 4, 6, 3, 64, 16, 64, torch.float32,
                                           fixed_len=seq_len)
        for window in (None, 1, 16, 17, 1000):
            ref = paged_decode_attention_ref(q, k, v, table, lens, 0.125, window)
            out = ext.paged_decode_attention(q, k, v, table, lens, 0.125, window or 0)
            check_close(out, ref, torch.float32)


def test_large_logits_are_stable(ext):
    gen = torch.Generator().manual_seed(2)
    q, k, v, table, lens = make_inputs(gen, 8, 4, 2, 64, 16, 200, torch.float32)
    out = ext.paged_decode_attention(q * 30, k, v, table, lens, 1.0, 0)  # logits ~ +-500
    assert torch.isfinite(out).all()
    # Scores this large carry float32 rounding of ~1e-4 into the softmax, so two float32 sums in
    # different orders differ by more than check_close allows: float64 arbitrates. The kernel must
    # be at least as close to it as torch's float32 reference (plus a little slack).
    ref64 = paged_decode_attention_ref((q * 30).double(), k.double(), v.double(), table, lens, 1.0)
    ref32 = paged_decode_attention_ref(q * 30, k, v, table, lens, 1.0)
    ours_err = (out.double() - ref64).abs().max().item()
    torch_err = (ref32.double() - ref64).abs().max().item()
    assert ours_err <= max(torch_err, 1e-5) * 1.5, (ours_err, torch_err)


def test_strided_block_table_rows(ext):
    gen = torch.Generator().manual_seed(3)
    q, k, v, table, lens = make_inputs(gen, 6, 8, 4, 64, 16, 150, torch.bfloat16)
    wide = torch.full((6, table.shape[1] + 5), -1, dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    out = ext.paged_decode_attention(q, k, v, wide[:, :table.shape[1]], lens, 0.125, 0)
    check_close(out, paged_decode_attention_ref(q, k, v, table, lens, 0.125), torch.bfloat16)


def test_rejects_bad_inputs(ext):
    gen = torch.Generator().manual_seed(4)
    q, k, v, table, lens = make_inputs(gen, 2, 4, 2, 64, 16, 40, torch.float32)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.paged_decode_attention(q, k.transpose(0, 1), v, table, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        ext.paged_decode_attention(q, k.bfloat16(), v, table, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="int32"):
        ext.paged_decode_attention(q, k, v, table.long(), lens, 0.125, 0)
    bad = table.clone()
    bad[0, 0] = k.shape[0]  # a block id that will be read must be in range
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_decode_attention(q, k, v, bad, lens, 0.125, 0)


def test_reference_matches_naive_loop():
    """The batched reference against a per-sequence, per-head loop written from the definition."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, table, lens = make_inputs(gen, 5, 6, 2, 32, 8, 70, torch.float32)
    bs, G = k.shape[1], 3
    for window in (None, 9):
        ref = paged_decode_attention_ref(q, k, v, table, lens, 0.3, window)
        for b in range(5):
            n = int(lens[b])
            slots = [int(table[b, t // bs]) * bs + t % bs for t in range(n)]
            kb, vb = k.reshape(-1, 2, 32)[slots], v.reshape(-1, 2, 32)[slots]
            lo = 0 if window is None else max(0, n - window)
            for h in range(6):
                p = torch.softmax(0.3 * kb[lo:, h // G] @ q[b, h], dim=0)
                torch.testing.assert_close(ref[b, h], p @ vb[lo:, h // G])


def test_public_entry_falls_back_for_unsupported_inputs():
    gen = torch.Generator().manual_seed(6)
    for dtype, head_dim in ((torch.float32, 40), (torch.float16, 64)):  # not for the C++ op
        q, k, v, table, lens = make_inputs(gen, 3, 4, 2, head_dim, 16, 50, dtype)
        out = paged_decode_attention(q, k, v, table, lens, 0.2, None)
        torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, table, lens, 0.2))
