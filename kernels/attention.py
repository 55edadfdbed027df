"""Attention kernels.

Paged decode attention (one query token per sequence) over a block-paged KV cache:
  q            (B, num_heads, head_dim)                              float32 / bfloat16
  k_cache      (num_blocks, block_size, num_kv_heads, head_dim)      same dtype (may be a view)
  v_cache      same as k_cache
  block_table  (B, max_blocks_per_seq) int32: entry j of row b = physical block holding
               tokens [j*block_size, (j+1)*block_size) of sequence b; entries past the
               sequence's length are garbage and never read.
  seq_lens     (B,) int32 >= 1: valid cached tokens, the current token included.
  query head h uses kv head h // (num_heads // num_kv_heads); sliding_window=W keeps only
  tokens t >= seq_len - W. Returns (B, num_heads, head_dim) in q's dtype (float32 math).
"""
import torch

from . import cpu_ext


def paged_decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, scale,
                               sliding_window=None):
    """Pure-torch reference (any device): gather every sequence's blocks, mask, softmax."""
    B, H, D = q.shape
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
    k = k_cache[blocks].reshape(B, n_blocks * bs, KVH, D).float()
    v = v_cache[blocks].reshape(B, n_blocks * bs, KVH, D).float()
    qg = q.float().reshape(B, KVH, G, D)
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
    if q.is_cuda and _triton_fits(q.shape[-1], k_cache.shape[1]):
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


def _triton_fits(head_dim: int, block_size: int) -> bool:
    from kernels.norm import triton_available

    power_of_two = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return power_of_two(head_dim) and power_of_two(block_size) and triton_available()
