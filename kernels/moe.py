"""Mixture-of-experts kernels: top-k routing and the experts' SwiGLU MLPs for a flat batch.

    route(router_logits, top_k, renormalize) -> (topk_ids (T, k) int32, topk_weights (T, k) float32)
    fused_experts(x, w13, w2, topk_ids, topk_weights) -> (T, H)

Layouts follow transformers' fused expert tensors (and vLLM's): w13 (E, 2I, H) holds each
expert's [gate; up] rows, w2 (E, H, I) its down projection. A topk id < 0 (or >= E) adds nothing:
with expert parallelism a rank passes the ids of experts it does not hold that way.

Each token's output sums its experts' weighted outputs in ascending expert id, starting from
zero, as transformers' eager loop does (index_add_ over experts in id order), so float32 results
agree with it up to the matmuls' own rounding.

`fused_experts` runs the C++ op of kernels/csrc/moe.cpp on CPU (float32 / bfloat16, when the
extension builds), the Triton kernels of kernels/triton_moe.py on CUDA (when triton is
installed), else `fused_experts_torch`. Both fused kernels stream each active expert's weights
once per call, round where the reference's torch ops round, and give each token a result that
does not depend on the rest of the batch (the C++ op bitwise; the reference's matmuls do not
promise that).
"""
import torch
import torch.nn.functional as F

from . import cpu_ext
from .norm import triton_available


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, the top k of it, renormalised to sum 1 when asked
    (Mixtral always; Qwen3-MoE by norm_topk_prob). Ties pick the lower expert id, as torch.topk."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over j (ascending topk_ids[t, j]) of topk_weights[t, j] * down(silu(gate x) * up x).

    x (T, H); w13 (E, 2I, H); w2 (E, H, I); topk_ids (T, k) int; topk_weights (T, k), cast to x's
    dtype before the multiply (as transformers does). Returns (T, H) in x's dtype."""
    fits = (x.ndim == 2 and (x.shape[1] <= 1 or x.stride(1) == 1) and w13.dtype == x.dtype == w2.dtype
            and w13.is_contiguous() and w2.is_contiguous() and topk_ids.dtype in (torch.int32, torch.int64)
            and topk_weights.is_floating_point())
    if fits and x.device.type == "cpu":
        ext = cpu_ext.ops_for(x.device, x.dtype)
        if ext is not None:
            return ext.fused_experts(x, w13, w2, topk_ids, topk_weights)
    if fits and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16) and triton_available():
        from kernels import triton_moe

        return triton_moe.fused_experts(x, w13, w2, topk_ids, topk_weights)
    return fused_experts_torch(x, w13, w2, topk_ids, topk_weights)


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor:
    """The reference: tokens grouped by expert, one matmul pair per expert that has tokens."""
    T, k = topk_ids.shape
    E, two_i, _ = w13.shape
    out = torch.zeros_like(x)
    if T == 0:
        return out
    ids = topk_ids.long()
    weights = topk_weights.to(x.dtype)
    valid = (ids >= 0) & (ids < E)
    # visit (token, slot) pairs by expert, then slot, then token: index_add_ then accumulates every
    # token's experts in ascending id, as transformers' loop over experts does, and each expert's
    # rows come in the order of transformers' torch.where over its (k, T) mask (a row's float32
    # matmul result can depend on its position among the rows: token order broke bit-equality)
    flat = torch.where(valid, ids, E).flatten()
    pair = torch.arange(T * k, device=x.device)
    order = torch.argsort(flat * (T * k) + (pair % k) * T + pair // k)
    counts = torch.bincount(flat, minlength=E + 1).tolist()
    start = 0
    for e in range(E):
        n = counts[e]
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // k
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights.flatten()[pairs, None]
        out.index_add_(0, tokens, y)
    return out
