"""Attention kernels.

Paged decode attention (one query token per sequence) over a block-paged KV cache:
  q            (B, num_heads, head_dim)                              float32 / bfloat16
  k_cache      (num_blocks, block_size, num_kv_heads, head_dim)      same dtype (may be a view), or
               int8 (..., head_dim + 4): rows of codes and a scale (kernels/kv_quant.py; not on CUDA)
  v_cache      same as k_cache
  block_table  (B, max_blocks_per_seq) int32: entry j of row b = physical block holding
               tokens [j*block_size, (j+1)*block_size) of sequence b; entries past the
               sequence's length are garbage and never read.
  seq_lens     (B,) int32 >= 1: valid cached tokens, the current token included.
  query head h uses kv head h // (num_heads // num_kv_heads); sliding_window=W keeps only
  tokens t >= seq_len - W. Returns (B, num_heads, head_dim) in q's dtype (float32 math).

Paged prefill attention (any number of query tokens per sequence: prompts, prompt chunks,
prefix-cache hits and decodes in one call), same cache layout:
  q            (T, num_heads, head_dim): the query tokens of B sequences, concatenated.
  cu_q_lens    (B+1,) int32: sequence b's queries are rows cu_q_lens[b]:cu_q_lens[b+1].
  seq_lens     (B,) int32: tokens in the cache after this step (context + q_len); the keys and
               values of all of them, this step's own included, are already in the cache.
  block_table  (B, max_blocks_per_seq) int32, as above.
  Query i of sequence b sits at position seq_len - q_len + i and sees keys at positions <= its
  own (causal, aligned bottom right); sliding_window=W keeps only keys > position - W. A q_len
  of 1 is a decode row with the decode op's semantics. Returns (T, num_heads, head_dim).
"""
import torch
import torch.nn.functional as F

from . import cpu_ext
from .kv_quant import dequantize_rows, is_codes


def _gather(cache, blocks, shape, dtype):
    """The cache rows of `blocks`, as values of `dtype` in `shape` (int8 rows dequantized)."""
    rows = cache[blocks]
    if is_codes(rows):
        return dequantize_rows(rows).reshape(shape).to(dtype)
    return rows.reshape(shape).to(dtype)


def paged_decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, scale,
                               sliding_window=None):
    """Pure-torch reference (any device): gather every sequence's blocks, mask, softmax. The math
    is float32, or float64 for a float64 q (the arbiter when two float32 results differ)."""
    B, H, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    _, bs, KVH, _ = k_cache.shape
    G = H // KVH
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    max_len = int(lens.max()) if B else 0
    n_blocks = (max_len + bs - 1) // bs
    # Block ids, with garbage entries (past each sequence's end) replaced by block 0.
    j = torch.arange(n_blocks, device=q.device)
    blocks = block_table[:, :n_blocks].to(device=q.device, dtype=torch.long)
    blocks = torch.where(j[None, :] * bs < lens[:, None], blocks, 0)
    # (B, T, KVH, D) with T = n_blocks * block_size token positions per sequence.
    k = _gather(k_cache, blocks, (B, n_blocks * bs, KVH, D), acc)
    v = _gather(v_cache, blocks, (B, n_blocks * bs, KVH, D), acc)
    qg = q.to(acc).reshape(B, KVH, G, D)
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale  # (B, KVH, G, T)
    t = torch.arange(n_blocks * bs, device=q.device)
    valid = t[None, :] < lens[:, None]
    if sliding_window is not None and sliding_window > 0:
        valid &= t[None, :] >= lens[:, None] - sliding_window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, v)
    return out.reshape(B, H, D).to(q.dtype)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale,
                           sliding_window=None):
    """C++ kernel on CPU when the extension builds (kernels.cpu_ext), the Triton kernel of
    kernels/triton_attention.py on CUDA (triton installed; power-of-two head and block sizes),
    else the reference."""
    if q.is_cuda and not is_codes(k_cache) and _triton_fits(q.shape[-1], k_cache.shape[1]):
        from kernels import triton_attention

        return triton_attention.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale,
                                                       sliding_window)
    if cpu_ext.supports_head_dim("attention", q.shape[-1]):
        ext = cpu_ext.ops_for(q.device, q.dtype)
        if ext is not None:
            return ext.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens,
                                              float(scale), int(sliding_window or 0))
    return paged_decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, scale,
                                      sliding_window)


def paged_prefill_attention_ref(q, k_cache, v_cache, block_table, cu_q_lens, seq_lens, scale,
                                sliding_window=None):
    """Pure-torch reference (any device): one sequence at a time, gather its tokens, mask, softmax."""
    T, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    G = H // KVH
    out = torch.empty_like(q)
    cu, lens = cu_q_lens.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        n_blocks = (seq_len + bs - 1) // bs
        blocks = block_table[b, :n_blocks].to(device=q.device, dtype=torch.long)
        k = _gather(k_cache, blocks, (n_blocks * bs, KVH, D), torch.float32)[:seq_len]  # (L, KVH, D)
        v = _gather(v_cache, blocks, (n_blocks * bs, KVH, D), torch.float32)[:seq_len]
        qg = q[cu[b]:cu[b + 1]].float().reshape(q_len, KVH, G, D)
        scores = torch.einsum("ikgd,tkd->kgit", qg, k) * scale  # (KVH, G, q_len, L)
        pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        t = torch.arange(seq_len, device=q.device)[None, :]
        see = t <= pos  # (q_len, L)
        if sliding_window is not None and sliding_window > 0:
            see &= t > pos - sliding_window
        probs = torch.softmax(scores.masked_fill(~see, float("-inf")), dim=-1)
        o = torch.einsum("kgit,tkd->ikgd", probs, v)  # (q_len, KVH, G, D)
        out[cu[b]:cu[b + 1]] = o.reshape(q_len, H, D).to(q.dtype)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_table, cu_q_lens, seq_lens, scale,
                            sliding_window=None):
    """The Triton kernel of kernels/triton_attention.py on CUDA (triton installed; power-of-two
    head and block sizes), the C++ kernel on CPU when the extension builds (kernels.cpu_ext), else
    torch's SDPA one sequence at a time."""
    if q.is_cuda and not is_codes(k_cache) and _triton_fits(q.shape[-1], k_cache.shape[1]):
        from kernels import triton_attention

        return triton_attention.paged_prefill_attention(q, k_cache, v_cache, block_table, cu_q_lens, seq_lens,
                                                        scale, sliding_window)
    if cpu_ext.supports_head_dim("attention", q.shape[-1]) and q.is_contiguous():
        ext = cpu_ext.ops_for(q.device, q.dtype)
        if ext is not None:
            return ext.paged_prefill_attention(q, k_cache, v_cache, block_table, cu_q_lens, seq_lens,
                                               float(scale), int(sliding_window or 0))
    return _prefill_sdpa(q, k_cache, v_cache, block_table, cu_q_lens, seq_lens, scale, sliding_window)


def _prefill_sdpa(q, k_cache, v_cache, block_table, cu_q_lens, seq_lens, scale, sliding_window=None):
    """paged_prefill_attention through torch's fused SDPA in q's dtype, one sequence at a time
    (memory-efficient where torch has a fused kernel, unlike the float32 reference)."""
    T, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    out = torch.empty_like(q)
    cu, lens = cu_q_lens.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        ctx = seq_len - (cu[b + 1] - cu[b])
        n_blocks = (seq_len + bs - 1) // bs
        blocks = block_table[b, :n_blocks].to(device=q.device, dtype=torch.long)
        k = _gather(k_cache, blocks, (n_blocks * bs, KVH, D), q.dtype)[:seq_len]
        v = _gather(v_cache, blocks, (n_blocks * bs, KVH, D), q.dtype)[:seq_len]
        mask = None
        if ctx or sliding_window:
            pos = torch.arange(ctx, seq_len, device=q.device)[:, None]
            t = torch.arange(seq_len, device=q.device)[None, :]
            mask = t <= pos
            if sliding_window:
                mask &= t > pos - sliding_window
        o = F.scaled_dot_product_attention(q[cu[b]:cu[b + 1]].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=H != KVH)
        out[cu[b]:cu[b + 1]] = o.transpose(0, 1)
    return out


def _triton_fits(head_dim: int, block_size: int) -> bool:
    from kernels.norm import triton_available

    power_of_two = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return power_of_two(head_dim) and power_of_two(block_size) and triton_available()
