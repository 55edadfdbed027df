"""Attention over the paged KV cache for one flattened step of tokens.

A step's tokens are ordered decodes first (one query token per sequence), then prefill chunks
(several query tokens per sequence: a fresh prompt, a chunk of a long one, or the rest of a
prompt after a prefix-cache hit). Every token's key and value are written into the cache
before attention runs, so attention reads keys only from the cache: an all-decode step takes
the paged decode kernel, any other step one call of the paged prefill kernel over all its
sequences (a decode is a sequence with one query). The KV cache of a layer is two tensors
(num_blocks, block_size, num_kv_heads, head_dim) (flash-attention's paged layout); token t of a
sequence lives in slot block_table[t // block_size] * block_size + t % block_size.
"""
from dataclasses import dataclass

import torch

from kernels.attention import paged_decode_attention, paged_prefill_attention


def device_tensor(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list (or CPU tensor) as a tensor on `device`. On a GPU through pinned memory,
    without waiting: a plain copy from pageable memory synchronizes the stream, so the step thread
    of async scheduling would wait for the step before to finish instead of queueing the next."""
    t = data.to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64
    num_decodes: int = 0
    # an all-decode step: one row per sequence
    decode_block_table: torch.Tensor | None = None  # (num_decodes, max_blocks) int32
    decode_seq_lens: torch.Tensor | None = None  # (num_decodes,) int32
    # any other step: every sequence of the step, in row order (see kernels/attention.py)
    block_table: torch.Tensor | None = None  # (B, max_blocks) int32
    cu_q_lens: torch.Tensor | None = None  # (B + 1,) int32: sequence b's rows are cu_q_lens[b]:cu_q_lens[b+1]
    seq_lens: torch.Tensor | None = None  # (B,) int32: cached tokens after this step, its own included


def step_metadata(md: AttentionMetadata, runs: list[tuple[list[int], int, int]], device) -> None:
    """Fill md's tensors for a step whose sequences, in row order, are runs of (block_ids, first
    position, number of tokens): the decode kernel's when every run is one token, else the
    prefill kernel's."""
    width = max(len(b) for b, _, _ in runs)
    table = device_tensor([b + [0] * (width - len(b)) for b, _, _ in runs], torch.int32, device)
    lens = device_tensor([s + n for _, s, n in runs], torch.int32, device)
    md.num_decodes = sum(n == 1 for _, _, n in runs)
    if md.num_decodes == len(runs):
        md.decode_block_table, md.decode_seq_lens = table, lens
        return
    cu = [0]
    for _, _, n in runs:
        cu.append(cu[-1] + n)
    md.block_table, md.seq_lens = table, lens
    md.cu_q_lens = device_tensor(cu, torch.int32, device)


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
    md.block_table = md.cu_q_lens = md.seq_lens = None


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
              scale: float, sliding_window: int | None) -> torch.Tensor:
    """q: (T, num_heads, head_dim), the step's keys and values already in the cache.
    Returns (T, num_heads * head_dim)."""
    T = q.shape[0]
    if md.num_decodes == T:
        out = paged_decode_attention(q, k_cache, v_cache, md.decode_block_table, md.decode_seq_lens,
                                     scale, sliding_window)
    else:
        out = paged_prefill_attention(q, k_cache, v_cache, md.block_table, md.cu_q_lens, md.seq_lens,
                                      scale, sliding_window)
    return out.view(T, -1)
