"""The Triton paged prefill attention kernel against its torch reference, and the reference against
torch's SDPA over each sequence's gathered keys with an explicit mask. In Triton's interpreter on
CPU (TRITON_INTERPRET=1, small shapes) and, when a GPU is present, compiled on it. Skipped when
triton is not installed."""
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernels import triton_attention  # noqa: E402
from kernels.attention import paged_decode_attention_ref, paged_prefill_attention_ref  # noqa: E402

# tests/conftest.py sets TRITON_INTERPRET=1 on a machine without a GPU (CPU tensors); with one,
# the kernels compile for it
DEVICES = ["cuda"] if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else ["cpu"]

# (cached context, q_len) per sequence: a fresh prompt, decodes (one after a partial block, one a
# one-token prompt), a chunk starting and ending inside blocks, a short chunk after a context over
# many blocks, and a prompt longer than one query tile (test_cases_span_several_query_tiles).
SEQS = [(0, 5), (7, 1), (6, 9), (37, 3), (0, 1), (3, 70), (20, 1)]


def _prefill_case(g, device, dtype, seqs, H=4, KVH=2, D=16, bs=4):
    """A cache whose unused slots (blocks no sequence owns, the tail of each last block) hold NaN,
    with a shuffled block table whose entries past a sequence's end point at an unused block: any
    read of a key the kernel must not see turns its output to NaN."""
    need = [(c + n + bs - 1) // bs for c, n in seqs]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seqs), max(need) + 1), int(perm[-1]), dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, KVH, D), float("nan"))
    v_cache = torch.full((num_blocks, bs, KVH, D), float("nan"))
    used = 0
    for b, ((c, n), nb) in enumerate(zip(seqs, need)):
        ids = perm[used:used + nb]
        used += nb
        table[b, :nb] = ids
        for cache in (k_cache, v_cache):
            kv = torch.randn(nb * bs, KVH, D, generator=g)
            kv[c + n:] = float("nan")
            cache[ids] = kv.view(nb, bs, KVH, D)
    q_lens = torch.tensor([n for _, n in seqs])
    cu_q_lens = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    q = torch.randn(int(q_lens.sum()), H, D, generator=g)
    return (q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), table.to(device),
            cu_q_lens.to(device), seq_lens.to(device))


def test_cases_span_several_query_tiles():
    assert max(n for _, n in SEQS) > triton_attention.prefill_tile_queries(4, 4) >= \
        triton_attention.prefill_tile_queries(4, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 17])
@pytest.mark.parametrize("KVH", [2, 4])
def test_paged_prefill_attention(device, dtype, window, KVH):
    g = torch.Generator().manual_seed(11)
    case = _prefill_case(g, device, dtype, SEQS, KVH=KVH)
    got = triton_attention.paged_prefill_attention(*case, 0.25, window)
    want = paged_prefill_attention_ref(*case, 0.25, window)
    assert not want.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # float32 math on exact bf16 inputs, then one rounding to bf16: toward zero in the interpreter
        # (the reference rounds to nearest), so up to two steps; on a GPU one step, plus the tf32
        # rounding of the probabilities in the p @ v matmul (2^-10 of the largest |v|; the cache's unused
        # slots hold NaN, left out of that largest)
        max_v = case[2].float().nan_to_num(0).abs().max()
        steps, atol = (1, 2 ** -10 * max_v) if device == "cuda" else (2, 1e-5)
        err = (got.float() - want.float()).abs()
        assert (err <= want.float().abs() * steps * 2 ** -7 + atol).all(), err.max()


def test_paged_prefill_attention_reads_views():
    """The engine passes q as a slice of the fused qkv projection and one layer's K/V as views into
    the whole cache (non-default strides); head_dim 8 also takes the padded-to-16 path of tl.dot."""
    g = torch.Generator().manual_seed(12)
    H, KVH, D = 4, 2, 8
    q, k_cache, v_cache, table, cu, lens = _prefill_case(g, DEVICES[0], torch.float32, SEQS[:4], H=H, KVH=KVH, D=D)
    qkv = torch.cat([q.reshape(-1, H * D), torch.randn(q.shape[0], 2 * KVH * D, generator=g).to(q.device)], dim=1)
    q_view = qkv[:, : H * D].view(-1, H, D)
    whole = torch.stack([torch.stack([k_cache, v_cache])] * 2)  # (layers, 2, blocks, bs, KVH, D)
    got = triton_attention.paged_prefill_attention(q_view, whole[1, 0], whole[1, 1], table, cu, lens, 0.3, 6)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, table, cu, lens, 0.3, 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5, 17])
@pytest.mark.parametrize("KVH", [2, 4])
def test_reference_matches_sdpa_per_sequence(window, KVH):
    """Pins the reference's semantics: query i of a sequence sits at position seq_len - q_len + i
    and sees keys t <= its position (and t > position - window)."""
    g = torch.Generator().manual_seed(13)
    H, bs = 4, 4
    q, k_cache, v_cache, table, cu, lens = _prefill_case(g, "cpu", torch.float32, SEQS, H=H, KVH=KVH, bs=bs)
    got = paged_prefill_attention_ref(q, k_cache, v_cache, table, cu, lens, 0.25, window)
    for b, (ctx, q_len) in enumerate(SEQS):
        t = torch.arange(ctx + q_len)
        slots = table[b, t // bs].long() * bs + t % bs
        k = k_cache.view(-1, KVH, q.shape[-1])[slots]  # (L, KVH, D)
        v = v_cache.view(-1, KVH, q.shape[-1])[slots]
        pos = torch.arange(ctx, ctx + q_len)[:, None]
        mask = t[None, :] <= pos
        if window is not None:
            mask &= t[None, :] > pos - window
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask, scale=0.25, enable_gqa=KVH != H).transpose(0, 1)
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_reference_decode_rows_match_decode_reference(window):
    """With q_len 1 everywhere the op is decode attention, sliding window convention included."""
    g = torch.Generator().manual_seed(14)
    seqs = [(0, 1), (7, 1), (20, 1), (37, 1)]
    q, k_cache, v_cache, table, cu, lens = _prefill_case(g, "cpu", torch.float32, seqs)
    got = paged_prefill_attention_ref(q, k_cache, v_cache, table, cu, lens, 0.25, window)
    k0, v0 = k_cache.nan_to_num(), v_cache.nan_to_num()  # the decode reference reads whole blocks
    torch.testing.assert_close(got, paged_decode_attention_ref(q, k0, v0, table, lens, 0.25, window))
