"""Triton fused-MoE kernels for CUDA: kernels.moe.fused_experts on GPU tensors; the torch reference
is kernels/moe.py's `fused_experts_torch` (same contract: each token's experts' weighted outputs
summed in ascending expert id from zero, ids outside [0, E) add nothing, weights cast to x's
dtype before the multiply).

The approach is vLLM's fused_moe (vllm/model_executor/layers/fused_moe/fused_moe.py and
moe_align_block_size.py): a grouped GEMM over the (token, slot) pairs sorted by expert, each
expert's run of pairs padded to a multiple of BLOCK_M so that every block of BLOCK_M rows
belongs to one expert and multiplies that expert's weights as one tile GEMM.

    align (torch ops, no host sync)  pairs sorted by (expert, token); blocks -> expert id
    _gate_up_kernel   per (block, BLOCK_N columns of I): gate and up tiles over H, then
                      silu(gate) * up -> act (P, I)               (vLLM: GEMM, then silu_and_mul)
    _down_kernel      per (block, BLOCK_N columns of H): act @ w2[e].T, times the pair's
                      weight -> y (P, H)
    _sum_kernel       per (token, BLOCK_H columns): the token's k rows of y added in ascending
                      expert id (vLLM's moe_sum adds them in slot order)

Rounding points follow the reference's torch ops in bfloat16 (gate, up, silu, its product, the
down output, the weighted output and each running sum are rounded to bf16; dot products in
float32), by an explicit round-to-nearest-even (`_round_bf16`), which also holds in Triton's
interpreter (whose float32 -> bf16 cast truncates). float32 dots run in IEEE float32, not TF32.
The tile shapes are fixed (not tuned per batch size): a token's result does not depend on the
batch it is in, beyond what tl.dot itself guarantees.

Tested against the reference in Triton's interpreter on CPU (TRITON_INTERPRET=1,
tests/kernels/test_triton_moe.py) and on a GPU when there is one. Block sizes are untuned
defaults (no GPU was at hand for tuning).
"""
import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_H = 16, 64, 64, 256


@triton.jit
def _round_bf16(x):
    """float32 -> the nearest-even bfloat16 value, as float32 (NaN not canonicalised)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _to_dtype(x, ROUND_BF16: tl.constexpr):
    if ROUND_BF16:
        x = _round_bf16(x)
    return x


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, H, I, stride_x,
                    TOP_K: tl.constexpr, ROUND_BF16: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:  # a block past the last expert's padded run
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs  # padding rows hold num_pairs
    token = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w13_ptr + e * 2 * I * H + offs_n[None, :].to(tl.int64) * H  # (1, BLOCK_N) row starts
    w_up = w_gate + I * H
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < H
        a = tl.load(x_ptr + token[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_gate + k[:, None], mask=w_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
        wu = tl.load(w_up + k[:, None], mask=w_mask, other=0.0)
        if WIDEN:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        if IEEE:
            gate = tl.dot(a, wg, gate, input_precision="ieee")
            up = tl.dot(a, wu, up, input_precision="ieee")
        else:
            gate = tl.dot(a, wg, gate)
            up = tl.dot(a, wu, up)
    gate = _to_dtype(gate, ROUND_BF16)
    up = _to_dtype(up, ROUND_BF16)
    silu = _to_dtype(gate / (1.0 + tl.exp(-gate)), ROUND_BF16)
    act = _to_dtype(silu * up, ROUND_BF16)
    tl.store(act_ptr + pair[:, None] * I + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, H, I,
                 ROUND_BF16: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w2_ptr + e * H * I + offs_n[None, :].to(tl.int64) * I
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < I
        a = tl.load(act_ptr + pair[:, None] * I + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if WIDEN:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)  # already in x's dtype's values
    y = _to_dtype(_to_dtype(acc, ROUND_BF16) * weight[:, None], ROUND_BF16)
    tl.store(y_ptr + pair[:, None] * H + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_kernel(y_ptr, by_expert_ptr, out_ptr, H, TOP_K: tl.constexpr, ROUND_BF16: tl.constexpr,
                BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(TOP_K):  # the token's pairs in ascending expert id; -1: an expert not held here
        pair = tl.load(by_expert_ptr + t * TOP_K + j).to(tl.int64)
        y = tl.load(y_ptr + tl.maximum(pair, 0) * H + offs, mask=ok, other=0.0).to(tl.float32)
        acc = tl.where(pair >= 0, _to_dtype(acc + y, ROUND_BF16), acc)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert): pair ids p = token * k + slot sorted by (expert, token), each
    expert's run padded with the value T * k to a multiple of block_m, and the expert of each block
    of block_m entries (-1 past the last run). Pairs of ids outside [0, E) are left out. Sized
    from the shapes alone (no host sync): T * k + min(E, T * k) * (block_m - 1) entries at most."""
    T, k = topk_ids.shape
    P, E, dev = T * k, num_experts, topk_ids.device
    flat = topk_ids.flatten().long()
    expert = torch.where((flat >= 0) & (flat < E), flat, E)  # E: left out
    order = torch.argsort(expert * max(T, 1) + torch.arange(P, device=dev) // k, stable=True)
    counts = torch.bincount(expert, minlength=E + 1)[:E]
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    sorted_expert = expert[order]
    held = sorted_expert < E
    e_held = sorted_expert.clamp(max=E - 1)
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[e_held]  # place within the expert's run
    dest = run_end[e_held] - padded[e_held] + rank
    num_blocks = (P + min(E, P) * (block_m - 1) + block_m - 1) // block_m
    sorted_pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs[dest[held]] = order[held].to(torch.int32)
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(run_end, block_start, right=True)
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """See kernels.moe.fused_experts: x (T, H) with a contiguous last dim, w13 (E, 2I, H) and
    w2 (E, H, I) contiguous, in x's dtype (float32 or bfloat16)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I, k = two_i // 2, topk_ids.shape[1]
    assert x.stride(-1) == 1 and w13.is_contiguous() and w2.is_contiguous(), "contiguous weights and rows"
    out = torch.empty_like(x)
    if T == 0:
        return out
    P = T * k
    sorted_pairs, block_expert = align_block_size(topk_ids, E, BLOCK_M)
    expert = torch.where((topk_ids >= 0) & (topk_ids < E), topk_ids.long(), E)
    slot_order = torch.argsort(expert, dim=1, stable=True)  # each token's slots by ascending expert id
    by_expert = torch.arange(T, device=x.device)[:, None] * k + slot_order
    by_expert = torch.where(torch.gather(expert, 1, slot_order) < E, by_expert, -1).to(torch.int32)
    weights = topk_weights.to(x.dtype).float().flatten()  # cast to x's dtype first, as the reference
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    rnd, ieee = x.dtype == torch.bfloat16, x.dtype == torch.float32
    # Triton's interpreter (CPU tensors) multiplies bf16 dot operands' raw bits (triton-lang/triton
    # issue 11584): there the tiles are widened to float32 first (the same products and float32 sums)
    widen = x.device.type != "cuda"
    num_blocks = block_expert.shape[0]
    _gate_up_kernel[(num_blocks, triton.cdiv(I, BLOCK_N))](
        x, w13, act, sorted_pairs, block_expert, P, H, I, x.stride(0), TOP_K=k, ROUND_BF16=rnd, IEEE=ieee, WIDEN=widen,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    _down_kernel[(num_blocks, triton.cdiv(H, BLOCK_N))](
        act, w2, y, weights, sorted_pairs, block_expert, P, H, I, ROUND_BF16=rnd, IEEE=ieee, WIDEN=widen,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    _sum_kernel[(T, triton.cdiv(H, BLOCK_H))](y, by_expert, out, H, TOP_K=k, ROUND_BF16=rnd, BLOCK_H=BLOCK_H)
    return out
