"""Triton paged attention on CUDA over the block-paged KV cache (GQA, block tables, sliding
window); the torch references are kernels/attention.py's `paged_decode_attention_ref` and
`paged_prefill_attention_ref`, with the same arguments and layouts (see that module's docstring).

Decode (one query token per sequence): one program per (sequence, query head) walks the
sequence's keys, BLOCK_N at a time gathered through the block table, with an online softmax in
float32.

Prefill (any number of query tokens per sequence: prompt chunks, prefix-cache hits and decodes
mixed): one program per (tile of a sequence's queries, kv head) takes the tile's queries for all
GROUP query heads of that kv head as the rows of one matrix, so each key is read once per group,
and walks key tiles of BLOCK_N tokens (gathered through the block table token by token, so the
tile size does not depend on block_size) from the first one the sliding window lets the tile's
first query see to the last one its last query sees, with a flash-attention style online softmax
in float32 and a causal/window mask per element. Both matmuls take float32 operands, in full
precision ("ieee") for float32 inputs; for 16-bit inputs in "tf32", which holds bf16/fp16 q, k, v exactly
and rounds only the probabilities (to 10 bits, finer than bf16). (Triton 3.9's interpreter
multiplies bf16 tl.dot operands as their raw uint16 bits, another reason to upcast first.)

Tested against the references in Triton's interpreter on CPU (TRITON_INTERPRET=1,
tests/kernels/test_triton.py, tests/kernels/test_triton_prefill.py) and on a GPU when there is
one. head_dim and block_size must be powers of two.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale, window,
                         sq_b, sq_h, sk_block, sk_tok, sk_head, sv_block, sv_tok, sv_head, st_b,
                         so_b, so_h, GROUP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // GROUP
    length = tl.load(lens_ptr + b)
    start = 0
    if window > 0:
        start = tl.maximum(length - window, 0)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + d).to(tl.float32)
    m = -float("inf")
    denom = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    # BLOCK_N keys a step, each through its block's entry in the table: every step is a dependent
    # chain of loads (table, then keys, then values), so fewer, wider steps (not one per block)
    for first in range(start // BLOCK_N * BLOCK_N, length, BLOCK_N):
        t = first + n
        valid = (t < length) & (t >= start)
        block = tl.load(table_ptr + b * st_b + t // BS, mask=valid, other=0).to(tl.int64)
        k = tl.load(k_ptr + block[:, None] * sk_block + (t % BS)[:, None] * sk_tok + kvh * sk_head + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))  # finite: every step holds a key at or after `start`
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + block[:, None] * sv_block + (t % BS)[:, None] * sv_tok + kvh * sv_head + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / denom
    tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty))


# Keys per step of the decode kernel (at least one cache block). On an H200 at a 1B Llama's shape
# (benchmarks/kernels_attention.py --device cuda, CUDA-graph replays) 64 ran 2.0-3.0x faster than
# one block of 16 a step from 1 to 256 sequences; 128 was faster still there at 1-8 sequences,
# but slower inside the engine's decode step at batch 1 (5.4 against 4.3 us a layer: the keys
# come cold from memory after the layer's matmuls).
DECODE_BLOCK_N = 64


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window=None,
                           block_n: int | None = None):
    """block_n: keys per step (a power of two; default max(DECODE_BLOCK_N, block_size))."""
    B, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "contiguous head_dim"
    out = torch.empty_like(q)
    _paged_decode_kernel[(B, H)](
        q, k_cache, v_cache, block_table, seq_lens, out, float(scale), int(sliding_window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), GROUP=H // KVH, BS=bs, D=D, BLOCK_N=block_n or max(DECODE_BLOCK_N, bs))
    return out


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, table_ptr, cu_q_ptr, lens_ptr, tile_seq_ptr, tile_start_ptr, out_ptr,
                          scale, window, sq_t, sq_h, sk_block, sk_tok, sk_head, sv_block, sv_tok, sv_head, st_b,
                          so_t, so_h, GROUP: tl.constexpr, GP: tl.constexpr, TQ: tl.constexpr, BS: tl.constexpr,
                          D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(tile_seq_ptr + pid)
    if b < 0:  # a spare program of the fixed-size grid
        return
    q_first = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_first
    ctx = tl.load(lens_ptr + b) - q_len
    i0 = tl.load(tile_start_ptr + pid)
    # Row r of the tile: query i0 + r // GP of the sequence, query head kvh * GROUP + r % GP
    # (GP = GROUP rounded up to a power of two; the padding rows are masked off).
    r = tl.arange(0, TQ * GP)
    i = i0 + r // GP
    h = kvh * GROUP + r % GP
    row_ok = (i < q_len) & (r % GP < GROUP)
    pos = ctx + i  # (M,) position of each row's query in its sequence
    d = tl.arange(0, DP)  # head_dim padded to 16 for tl.dot; the padding is zeros
    d_ok = d < D
    q_rows = (q_first + i).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * sq_t + h[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (M, DP)
    # Keys [lo, hi): from the window start of the tile's first query to its last query.
    hi = ctx + tl.minimum(i0 + TQ, q_len)
    lo = 0
    if window > 0:
        lo = tl.maximum(ctx + i0 - window + 1, 0)
    m = tl.full([TQ * GP], -float("inf"), tl.float32)
    denom = tl.zeros([TQ * GP], dtype=tl.float32)
    acc = tl.zeros([TQ * GP, DP], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        t = start + n  # (N,) key positions
        t_ok = (t >= lo) & (t < hi)
        block = tl.load(table_ptr + b * st_b + t // BS, mask=t_ok, other=0).to(tl.int64)
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * sk_block + (t % BS)[:, None] * sk_tok + kvh * sk_head + d[None, :],
                    mask=kv_ok, other=0.0).to(tl.float32)  # (N, DP)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (M, N)
        see = t[None, :] <= pos[:, None]
        if window > 0:
            see &= t[None, :] > pos[:, None] - window
        s = tl.where(see, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 there so exp gives 0, not nan.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        v = tl.load(v_ptr + block[:, None] * sv_block + (t % BS)[:, None] * sv_tok + kvh * sv_head + d[None, :],
                    mask=kv_ok, other=0.0).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(row_ok, denom, 1.0)[:, None]  # a real row sees at least its own key
    o_rows = (q_first + i).to(tl.int64)
    tl.store(out_ptr + o_rows[:, None] * so_t + h[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


PREFILL_BLOCK_M = 64  # rows (queries x padded group heads) per program
PREFILL_BLOCK_N = 32  # key tokens per inner step


def prefill_tile_queries(num_heads: int, num_kv_heads: int) -> int:
    """Queries per program: PREFILL_BLOCK_M rows shared by the group's query heads."""
    return max(PREFILL_BLOCK_M // triton.next_power_of_2(num_heads // num_kv_heads), 1)


def paged_prefill_attention(q, k_cache, v_cache, block_table, cu_q_lens, seq_lens, scale, sliding_window=None):
    T, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    assert D & (D - 1) == 0 and bs & (bs - 1) == 0, "head_dim and block_size must be powers of two"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "contiguous head_dim"
    out = torch.empty_like(q)
    B = seq_lens.shape[0]
    if T == 0:
        return out
    tq = prefill_tile_queries(H, KVH)
    # Program -> (sequence, first query of its tile), built on the device without a host sync: a
    # sequence has ceil(q_len / tq) tiles, at most T // tq + B in all, so the grid has that many
    # programs and the spare ones get sequence -1.
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).long()
    tiles = (q_lens + tq - 1) // tq
    cu_tiles = torch.cumsum(tiles, 0)
    pid = torch.arange(T // tq + B, device=q.device)
    tile_seq = torch.searchsorted(cu_tiles, pid, right=True)  # B for a spare program
    tile_start = ((pid - (cu_tiles - tiles)[tile_seq.clamp(max=B - 1)]) * tq).to(torch.int32)
    tile_seq = torch.where(tile_seq < B, tile_seq, -1).to(torch.int32)
    _paged_prefill_kernel[(pid.numel(), KVH)](
        q, k_cache, v_cache, block_table, cu_q_lens, seq_lens, tile_seq, tile_start, out, float(scale),
        int(sliding_window or 0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=H // KVH, GP=triton.next_power_of_2(H // KVH), TQ=tq, BS=bs, D=D, DP=max(D, 16),
        BLOCK_N=PREFILL_BLOCK_N, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
