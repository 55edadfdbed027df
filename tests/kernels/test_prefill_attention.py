"""The C++ CPU paged prefill attention op (and the SDPA fallback) against the float32 reference:
ragged steps mixing fresh prompts, chunks after cached context (prefix hits, chunked prefill)
and decode rows, GQA and MHA, sliding windows, scattered blocks."""
import math

import pytest
import torch

from kernels.attention import _prefill_sdpa, paged_prefill_attention, paged_prefill_attention_ref


def ragged_step(gen, q_lens, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """q for the step's rows and a cache (a layer view of a two-layer one) whose blocks are
    scattered at random; entries past each sequence's blocks and unused slots hold NaN, so a
    kernel that reads a key it must not see returns NaN."""
    lens = [c + n for c, n in zip(contexts, q_lens)]
    max_blocks = max((n + block_size - 1) // block_size for n in lens) + 2
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 5
    kv = torch.full((2, 2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lens), max_blocks), -7, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        k = (n + block_size - 1) // block_size
        table[b, :k] = perm[used:used + k].to(torch.int32)
        used += k
        for t in range(n):  # only the sequence's tokens get values
            blk, off = int(table[b, t // block_size]), t % block_size
            kv[1, :, blk, off] = torch.randn(2, num_kv_heads, head_dim, generator=gen)
    kv = kv.to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return q, kv[1, 0], kv[1, 1], table, cu, torch.tensor(lens, dtype=torch.int32)


def check_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out.float()).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # both round a float32 result to bf16: about one bf16 step apart
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


STEPS = {  # (q_lens, cached contexts)
    "fresh prompts": ([128, 128, 37], [0, 0, 0]),
    "mixed": ([1, 1, 70, 5, 3, 16], [40, 0, 0, 11, 37, 16]),  # decodes, prompt, chunks inside blocks
    "long chunk after long context": ([150], [300]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 1, 17, 100], ids=lambda w: f"win{w}")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # the default model's shape (GQA 3)
    (8, 2, 128, 32),  # GQA 4, head_dim 128
    (4, 4, 96, 16),   # MHA, the generic head_dim path
])
@pytest.mark.parametrize("step", list(STEPS))
def test_matches_reference(ext, dtype, sliding_window, num_heads, num_kv_heads, head_dim, block_size, step):
    gen = torch.Generator().manual_seed(hash((step, head_dim)) % 2**31)
    q, k, v, table, cu, lens = ragged_step(gen, *STEPS[step], num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = 1 / math.sqrt(head_dim)
    ref = paged_prefill_attention_ref(q, k, v, table, cu, lens, scale, sliding_window)
    check_close(ext.paged_prefill_attention(q, k, v, table, cu, lens, scale, sliding_window or 0), ref, dtype)
    check_close(paged_prefill_attention(q, k, v, table, cu, lens, scale, sliding_window), ref, dtype)  # public entry
    check_close(_prefill_sdpa(q, k, v, table, cu, lens, scale, sliding_window), ref, dtype)  # the torch fallback


def test_large_logits_are_stable(ext):
    gen = torch.Generator().manual_seed(2)
    q, k, v, table, cu, lens = ragged_step(gen, [90, 1], [20, 60], 4, 2, 64, 16, torch.float32)
    out = ext.paged_prefill_attention(q * 30, k, v, table, cu, lens, 1.0, 0)  # logits ~ +-500
    check_close(out, paged_prefill_attention_ref(q * 30, k, v, table, cu, lens, 1.0), torch.float32)


def test_rejects_bad_inputs(ext):
    gen = torch.Generator().manual_seed(4)
    q, k, v, table, cu, lens = ragged_step(gen, [5, 3], [0, 9], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.paged_prefill_attention(q, k.transpose(0, 1), v, table, cu, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        ext.paged_prefill_attention(q, k.bfloat16(), v, table, cu, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="cu_q_lens"):
        ext.paged_prefill_attention(q, k, v, table, cu[:-1], lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="out of range"):  # more queries than cached tokens
        ext.paged_prefill_attention(q, k, v, table, cu, torch.tensor([4, 12], dtype=torch.int32), 0.125, 0)
    bad = table.clone()
    bad[1, 0] = k.shape[0]  # a block id that will be read must be in range
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_prefill_attention(q, k, v, bad, cu, lens, 0.125, 0)
