"""Triton greedy pass on CUDA: each row's first argmax and its log-softmax in one read of the
logits; its torch reference is kernels/sampling.py's `greedy_ref`. One program per row walks
the vocabulary in blocks with a running max, sum of exponentials and best index (ties keep
the first). Tested against the reference in Triton's interpreter on CPU
(tests/kernels/test_triton.py).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_kernel(x_ptr, ids_ptr, lp_ptr, V, stride, WITH_LOGPROBS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = -float("inf")
    best_id = 0
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        block_id = tl.argmax(x, axis=0, tie_break_left=True)
        better = block_max > best  # (a tie with an earlier block keeps the earlier index)
        best_id = tl.where(better, start + block_id, best_id)
        best = tl.where(better, block_max, best)
        if WITH_LOGPROBS:
            m_new = tl.maximum(m, block_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
    tl.store(ids_ptr + row, best_id.to(tl.int64))
    if WITH_LOGPROBS:
        tl.store(lp_ptr + row, best - (m + tl.log(s)))


def greedy(logits: torch.Tensor, with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See kernels.sampling.greedy_ref: (N,) int64 ids and (N,) float32 logprobs (or None)."""
    N, V = logits.shape
    assert logits.stride(-1) == 1, "contiguous rows"
    ids = torch.empty(N, dtype=torch.int64, device=logits.device)
    lps = torch.empty(N, dtype=torch.float32, device=logits.device) if with_logprobs else ids
    if N:
        _greedy_kernel[(N,)](logits, ids, lps, V, logits.stride(0), WITH_LOGPROBS=with_logprobs,
                             BLOCK=min(4096, triton.next_power_of_2(V)))
    return ids, (lps if with_logprobs else None)
