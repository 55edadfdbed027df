"""Triton sampling passes on CUDA, one program per row; torch references in kernels/sampling.py.

`greedy`: each row's first argmax and its log-softmax in one read of the logits (reference
`greedy_ref`): a running max, sum of exponentials and best index (ties keep the first).

`sample`: temperature, top-k, top-p, min-p, an inverse-CDF draw at a given u and the drawn
token's logprob under the filtered distribution (reference `sample_filtered_ref`), without a
sort. Each filter keeps the tokens at or above a value, so each threshold is found by searching
on the value: float32s map to integer keys in the same order, and a pass over the row counts
(top-k) or sums the mass (top-p) at or above NUM_CANDIDATES keys at once, narrowing the key
range 16-fold: at most 8 passes, and the threshold lands exactly on a logit. Passes over V:
1 (max, sum) + <= 8 (top-k) + 1 (top-k's mass, when top-p follows) + <= 8 (top-p) + 1 (the
kept set's normaliser) + <= 1 (the draw, which stops at its token); a filter that is off costs
no pass. Semantics: top-k keeps every token tied at the k-th value (as sample_ref_filter and
filter_logits without top-p; filter_logits with top-p on cuts them by sort rank); top-p cuts
a group of equal values in vocabulary order, as a stable sort orders them (torch's CPU sort
leaves their order unspecified); min-p keeps exp(x - max) >= min_p (p >= min_p * p_max up to
rounding). Float sums differ from torch's, so a verdict within rounding of a cut may too. When
rounding carries u * total past the last kept token (u within rounding of 1), the draw is that
token, where sample_from_probs takes the argmax.

Both are tested against their references in Triton's interpreter on CPU
(tests/kernels/test_triton.py, tests/kernels/test_triton_sampling.py).
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
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a block of banned (-inf) tokens: no nan
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
            m = m_new
    tl.store(ids_ptr + row, best_id.to(tl.int64))
    if WITH_LOGPROBS:
        tl.store(lp_ptr + row, best - (m + tl.log(s)))


GREEDY_BLOCK = 16384


def greedy(logits: torch.Tensor, with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See kernels.sampling.greedy_ref: (N,) int64 ids and (N,) float32 logprobs (or None)."""
    N, V = logits.shape
    assert logits.stride(-1) == 1, "contiguous rows"
    ids = torch.empty(N, dtype=torch.int64, device=logits.device)
    lps = torch.empty(N, dtype=torch.float32, device=logits.device) if with_logprobs else ids
    if N:
        # 16 warps over blocks of 16K: a 49K vocabulary in 3 steps, each a reduction across the
        # program (12 steps of 4K with 4 warps: 15.6 instead of 6.1 us a row on an H200)
        _greedy_kernel[(N,)](logits, ids, lps, V, logits.stride(0), WITH_LOGPROBS=with_logprobs,
                             BLOCK=min(GREEDY_BLOCK, triton.next_power_of_2(V)), num_warps=16)
    return ids, (lps if with_logprobs else None)


NUM_CANDIDATES = 16  # thresholds tried per pass of a search: 4 of the key's 32 bits a pass
NEG_INF_KEY = tl.constexpr(-2139095041)  # _float_key(-inf), the smallest key of a non-NaN float32


@triton.jit
def _float_key(x):
    """float32 -> int64 key in the same order (-0.0 one below +0.0): floats searched as integers."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _key_float(k):
    """Inverse of _float_key (keys of non-NaN floats)."""
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _keep_block(x, valid, ties_before, t_p, g_p, e_p, mass_p, min_p, m):
    """A block's kept tokens and their exp(x - m): above the top-p value t_p, or tied at it with a
    rank r among the ties (vocabulary order, as a stable descending sort has them) that top-p keeps
    (mass before it g_p + r * e_p < mass_p; the first always); and min-p: exp(x - m) >= min_p,
    i.e. p >= min_p * p_max. Also returns the block's number of ties."""
    tie = valid & (x == t_p)
    r = ties_before + tl.cumsum(tie.to(tl.int32), 0) - tie.to(tl.int32)
    keep_tie = tie & ((r == 0) | (g_p + r.to(tl.float32) * e_p < mass_p))
    e = tl.exp(x - m)
    keep = ((x > t_p) | keep_tie) & (e >= min_p) & valid & (x > -float("inf"))
    return keep, tl.where(keep, e, 0.0), tl.sum(tie.to(tl.int32), 0)


@triton.jit
def _sample_kernel(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, u_ptr, ids_ptr, lp_ptr, keep_ptr, V, stride,
                   WITH_LOGPROBS: tl.constexpr, WRITE_KEEP: tl.constexpr, BLOCK: tl.constexpr, NC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * stride
    temp = tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    j = tl.arange(0, NC).to(tl.int64)
    # every pass reads x = logits / temperature as torch has it (IEEE division; -inf past V)

    # the row's max m and z = sum(exp(x - m)), online (a block of banned, -inf logits adds nothing)
    m = -float("inf")
    z = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.math.div_rn(tl.load(x_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32), temp)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_ref = tl.where(m_new > -float("inf"), m_new, 0.0)  # (no inf - inf while the row is all -inf)
        z = z * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), 0)
        m = m_new

    # top-k: tau_k = the k-th largest value (ties at it kept, as `x < kth` masking does) = the
    # largest key t with count(x >= t) >= k; invariant: lo holds, hi does not
    lo = tl.full((), NEG_INF_KEY, tl.int64)
    if (top_k > 0) & (top_k < V):
        hi = _float_key(m) + 1
        while hi - lo > 1:
            t = lo + ((hi - lo) * j) // NC  # (NC,) from lo up, below hi
            w = _key_float(t)
            count = tl.zeros((NC,), tl.int32)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.math.div_rn(tl.load(x_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32), temp)
                ge = (offs < V)[:, None] & (x[:, None] >= w[None, :])  # (BLOCK, NC)
                count += tl.sum(ge.to(tl.int32), 0)
            holds = count >= top_k  # true for a prefix of t
            hi = tl.min(tl.where(holds, hi, t), 0)
            lo = tl.max(tl.where(holds, t, lo), 0)
    tau_k = _key_float(lo)

    # top-p over the top-k survivors (mass z_k): t_p = the smallest value whose strictly larger
    # survivors hold mass g_p < top_p * z_k = mass_p; invariant: hi holds (g(m) = 0), lo does not.
    # It is >= c = m + log((1 - top_p) * z_k / V) - 1: the tokens below c hold < (1 - top_p) * z_k / e
    t_p = tau_k
    g_p = 0.0
    e_p = 0.0
    mass_p = float("inf")  # top-p off: every tie at tau_k kept
    if top_p < 1:
        z_k = z
        if tau_k > -float("inf"):
            z_k = 0.0
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.math.div_rn(tl.load(x_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32), temp)
                z_k += tl.sum(tl.where(x >= tau_k, tl.exp(x - m), 0.0), 0)
        mass_p = top_p * z_k
        hi = _float_key(m)
        c = m + tl.log((1 - top_p) * z_k / V) - 1
        lo = tl.minimum(tl.maximum(lo, _float_key(c)), hi) - 1  # (never tested: t[0] below)
        while hi - lo > 1:
            t = lo + ((hi - lo) * j) // NC
            w = _key_float(t)
            mass = tl.zeros((NC,), tl.float32)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.math.div_rn(tl.load(x_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32), temp)
                gt = x[:, None] > w[None, :]  # (BLOCK, NC)
                mass += tl.sum(tl.where(gt, tl.exp(x - m)[:, None], 0.0), 0)
            holds = (mass < mass_p) & (j > 0)  # true for a suffix of t (mass falls as t rises)
            g_p = tl.max(tl.where(holds, mass, g_p), 0)  # the mass at the first t that holds
            hi = tl.min(tl.where(holds, t, hi), 0)
            lo = tl.max(tl.where(holds, lo, t), 0)
        t_p = _key_float(hi)
        e_p = tl.exp(t_p - m)

    # the kept set's normaliser (z itself when no filter is on)
    z_keep = z
    if (tau_k > -float("inf")) | (top_p < 1) | (min_p > 0) | WRITE_KEEP:
        z_keep = 0.0
        ties = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.math.div_rn(tl.load(x_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32), temp)
            keep, e, num_ties = _keep_block(x, offs < V, ties, t_p, g_p, e_p, mass_p, min_p, m)
            z_keep += tl.sum(e, 0)
            ties += num_ties
            if WRITE_KEEP:
                tl.store(keep_ptr + row * V + offs, keep.to(tl.int8), mask=offs < V)

    # inverse CDF in vocabulary order: the first kept token whose cumulative mass exceeds
    # u * z_keep (none, from rounding when u is within an ulp of 1: the last kept token)
    target = tl.load(u_ptr + row) * z_keep
    acc = 0.0
    ties = 0
    first = V
    last = -1
    start = 0
    while (start < V) & (first == V):
        offs = start + tl.arange(0, BLOCK)
        x = tl.math.div_rn(tl.load(x_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32), temp)
        keep, e, num_ties = _keep_block(x, offs < V, ties, t_p, g_p, e_p, mass_p, min_p, m)
        first = tl.min(tl.where(keep & (acc + tl.cumsum(e, 0) > target), offs, V), 0)
        last = tl.maximum(last, tl.max(tl.where(keep, offs, -1), 0))
        acc += tl.sum(e, 0)
        ties += num_ties
        start += BLOCK
    token = tl.where(first < V, first, tl.maximum(last, 0))  # (0: a row with nothing kept, all -inf)
    tl.store(ids_ptr + row, token.to(tl.int64))
    if WITH_LOGPROBS:
        x_token = tl.math.div_rn(tl.load(x_ptr + token).to(tl.float32), temp)
        tl.store(lp_ptr + row, x_token - (m + tl.log(z_keep)))


def _launch(logits, temperature, top_k, top_p, min_p, u, with_logprobs, keep):
    N, V = logits.shape
    assert logits.stride(-1) == 1, "contiguous rows"
    ids = torch.empty(N, dtype=torch.int64, device=logits.device)
    lps = torch.empty(N, dtype=torch.float32, device=logits.device) if with_logprobs else ids
    if N:
        _sample_kernel[(N,)](logits, temperature, top_k, top_p, min_p, u, ids, lps, ids if keep is None else keep,
                             V, logits.stride(0), WITH_LOGPROBS=with_logprobs, WRITE_KEEP=keep is not None,
                             BLOCK=min(1024, triton.next_power_of_2(V)), NC=NUM_CANDIDATES, num_warps=8)
    return ids, (lps if with_logprobs else None)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, u: torch.Tensor, with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See kernels.sampling.sample_filtered_ref: (N,) int64 ids drawn at u from the filtered
    distribution and (optionally) their (N,) float32 logprobs under it. logits (N, V) float32 or
    bf16; temperature (> 0), top_p (1 = off), min_p (0 = off), u in [0, 1): (N,) float32;
    top_k (N,) int64 (0 = off)."""
    return _launch(logits, temperature, top_k, top_p, min_p, u, with_logprobs, None)


def filter_mask(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """(N, V) bool: the tokens sample's filters keep (what the tests compare with torch's filter)."""
    keep = torch.empty(logits.shape, dtype=torch.int8, device=logits.device)
    _launch(logits, temperature, top_k, top_p, min_p, torch.zeros_like(temperature), False, keep)
    return keep.bool()
