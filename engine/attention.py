"""Attention over the paged KV cache for one flattened step of tokens.

A step's tokens are ordered decodes first (one query token per sequence, handled by the
paged decode kernel in one call), then prefill chunks (several query tokens per sequence,
handled one sequence at a time by torch's fused SDPA over the sequence's gathered blocks).
The KV cache of a layer is two tensors (num_blocks, block_size, num_kv_heads, head_dim)
(flash-attention's paged layout); token t of a sequence lives in slot
block_table[t // block_size] * block_size + t % block_size.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.attention import paged_decode_attention


@dataclass
class PrefillChunk:
    q_start: int  # first row of this sequence's query tokens in the step
    q_len: int
    seq_len: int  # tokens in the cache after this step (context + q_len)
    block_ids: torch.Tensor | None  # (num_blocks,) int64; None when there is no context
    mask: torch.Tensor | None = None  # (q_len, seq_len) bool, True = attend; None = plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64
    num_decodes: int = 0
    decode_block_table: torch.Tensor | None = None  # (num_decodes, max_blocks) int32
    decode_seq_lens: torch.Tensor | None = None  # (num_decodes,) int32
    prefills: list[PrefillChunk] = field(default_factory=list)


def prefill_mask(ctx_len: int, q_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """Causal mask aligned to the bottom right: query i (at position ctx_len + i) sees keys <= it."""
    if ctx_len == 0 and sliding_window is None:
        return None
    q_pos = torch.arange(ctx_len, ctx_len + q_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len + q_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def per_token_decode_rows(md: AttentionMetadata, runs: list[tuple[list[int], int, int]], device) -> None:
    """Batch-invariant attention: make every token of the step a decode row of its own (query at
    position p over keys 0..p of its sequence, all already in the cache), so a token's attention
    is the decode kernel's fixed-order sum whether its sequence was prefilled in one chunk, in
    several, or decoded, alone or in any batch. runs: (block_ids, first position, number of
    tokens) of each sequence's tokens, in row order."""
    width = max(len(b) for b, _, _ in runs)
    table = torch.tensor([b + [0] * (width - len(b)) for b, _, _ in runs], dtype=torch.int32)
    counts = torch.tensor([n for _, _, n in runs])
    md.decode_block_table = table.repeat_interleave(counts, dim=0).to(device)
    md.decode_seq_lens = torch.cat([torch.arange(s + 1, s + n + 1, dtype=torch.int32) for _, s, n in runs]).to(device)
    md.num_decodes = int(counts.sum())
    md.prefills = []


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              md: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim), already in the cache.
    Returns (T, num_heads * head_dim)."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    nd = md.num_decodes
    if nd == T:
        out = paged_decode_attention(q, k_cache, v_cache, md.decode_block_table, md.decode_seq_lens,
                                     scale, sliding_window)
        return out.view(T, num_heads * head_dim)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, md.decode_block_table, md.decode_seq_lens,
                                          scale, sliding_window)
    for p in md.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        if p.block_ids is None:  # no cached context: attend to this step's own keys
            kk, vv = k[rows], v[rows]
        else:
            kk = k_cache[p.block_ids].view(-1, num_kv_heads, head_dim)[: p.seq_len]  # (L, Hkv, D)
            vv = v_cache[p.block_ids].view(-1, num_kv_heads, head_dim)[: p.seq_len]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),  # (H, L, D)
            attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[rows] = o.transpose(0, 1)
    return out.view(T, num_heads * head_dim)
